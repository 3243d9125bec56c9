"""Prefix-stability assertions for users' own tests (seed 000: "Add a CI test that two prompts
differing only in the user message share the same leading token fingerprint").

``assert_shared_prefix(a, b, tokenizer, n=2048)`` fails with a readable token diff;
:class:`GoldenFingerprints` backs the ``prefix_fingerprint`` pytest fixture.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvreuse.lint.fingerprint import PrefixFingerprint, Revisions, fingerprint
from kvreuse.lint.reuse import block_reuse
from kvreuse.tokenizers.contract import Tokenizer

PromptLike = str | Sequence[int]
WINDOW = 6


def _resolve(tokenizer: Any) -> Tokenizer | None:
    """A Tokenizer, a TokenizerBundle, a tokenizer name/directory, or None (token ids given)."""
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    inner = getattr(tokenizer, "tokenizer", None)
    if isinstance(inner, Tokenizer):
        return inner
    if isinstance(tokenizer, str | Path):
        from kvreuse.tokenizers import load_tokenizer

        return load_tokenizer(tokenizer).tokenizer
    raise TypeError(f"not a tokenizer: {tokenizer!r}")


def _ids(prompt: PromptLike, tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("text prompts need a tokenizer")
        return tokenizer.encode(prompt)
    return list(prompt)


def _pieces(ids: Sequence[int], tokenizer: Tokenizer | None) -> str:
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    return " ".join(f"{tokenizer.decode([i])!r}:{i}" for i in ids)


def token_diff(a: Sequence[int], b: Sequence[int], tokenizer: Tokenizer | None) -> str:
    """A few lines that show where two token sequences part and what each has there."""
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if shared is None:
        shared = min(len(a), len(b))
    before = a[max(0, shared - WINDOW) : shared]
    lines = [
        f"first difference at token {shared} (a has {len(a)} tokens, b has {len(b)})",
        f"  shared ...{_pieces(before, tokenizer)}",
        f"  a: {_pieces(a[shared : shared + WINDOW], tokenizer) or '<end>'}",
        f"  b: {_pieces(b[shared : shared + WINDOW], tokenizer) or '<end>'}",
    ]
    if tokenizer is not None:
        lines.append(f"  a text: ...{tokenizer.decode(list(a[max(0, shared - 3) : shared + 8]))!r}")
        lines.append(f"  b text: ...{tokenizer.decode(list(b[max(0, shared - 3) : shared + 8]))!r}")
    return "\n".join(lines)


def assert_shared_prefix(
    a: PromptLike, b: PromptLike, tokenizer: Any = None, n: int = 2048, block_size: int = 16
) -> int:
    """Assert that ``a`` and ``b`` have the same first ``n`` tokens (texts are tokenized whole,
    as the engine will). Returns the number of shared leading tokens."""
    tok = _resolve(tokenizer)
    ids_a, ids_b = _ids(a, tok), _ids(b, tok)
    shared = next(
        (i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y),
        min(len(ids_a), len(ids_b)),
    )
    if ids_a[:n] == ids_b[:n]:
        return shared
    reused = block_reuse(shared, len(ids_b), block_size)
    raise AssertionError(
        f"prompts differ within their first {n} tokens: they share {shared} tokens "
        f"(a block cache of {block_size} reuses {reused})\n{token_diff(ids_a, ids_b, tok)}"
    )


class GoldenFingerprints:
    """A JSON file of named fingerprints: compare, or (update mode) rewrite on mismatch."""

    def __init__(self, path: Path, update: bool) -> None:
        self.path = path
        self.update = update
        self._data: dict[str, Any] = {}
        if path.is_file():
            loaded = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                self._data = loaded
        self._dirty = False

    def check(
        self,
        key: str,
        prompt: PromptLike,
        tokenizer: Any = None,
        n: int = 2048,
        block_size: int = 16,
        revisions: Revisions | None = None,
    ) -> PrefixFingerprint:
        tok = _resolve(tokenizer)
        if revisions is None and tok is not None:
            revisions = Revisions(tokenizer=tok.revision)
        current = fingerprint(_ids(prompt, tok), n=n, block_size=block_size, revisions=revisions)
        stored = self._data.get(key)
        if self.update:
            if stored != current.to_json():
                self._data[key] = current.to_json()
                self._dirty = True
            return current
        if stored is None:
            raise AssertionError(
                f"no golden prefix fingerprint {key!r} in {self.path}; run pytest with "
                "--kvreuse-update-golden to record it"
            )
        golden = PrefixFingerprint.from_json(stored, f"{self.path}: {key}")
        if golden.digest == current.digest:
            return current
        changed = golden.revisions.changed_fields(current.revisions)
        block = golden.first_different_block(current)
        where = (
            "all shared blocks equal (the prefix length changed)"
            if block is None
            else f"first changed block {block} (tokens {block * block_size}-"
            f"{(block + 1) * block_size - 1})"
        )
        cause = f"{', '.join(changed)} revision changed" if changed else "the tokens changed"
        raise AssertionError(
            f"prefix fingerprint {key!r} changed: {cause}; {where}. A deploy of this change "
            "starts with a cold prefix cache; if it is intended, rerun with "
            "--kvreuse-update-golden"
        )

    def save(self) -> None:
        if self._dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(self._data, indent=2, sort_keys=True) + "\n"
            self.path.write_text(text, encoding="utf-8")
            self._dirty = False
