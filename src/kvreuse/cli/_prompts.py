"""Shared I/O for the prompt commands: tokenizer and template options, request files, the clock.

Request files: ``.json`` holds one request object or a list of them; ``.jsonl`` one per line
(logged requests; a line may wrap the body as ``{"body": {...}}`` or ``{"request": {...}}``);
any other file is a raw text prompt.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreuse.cli.args import positive_int, read_bytes
from kvreuse.cli.files import write_whole
from kvreuse.cli.tables import make_console, progress_bar
from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.json_input import parse_json, utf8_text
from kvreuse.lint.fingerprint import DEFAULT_BLOCK_SIZE, Revisions
from kvreuse.tokenizers import NAMED_TOKENIZERS, TokenizerBundle, load_tokenizer

if TYPE_CHECKING:  # rendering needs jinja2 (the lint extra); import it when a command runs
    from kvreuse.lint.prompt import Prompt
    from kvreuse.tokenizers.chat_template import ChatTemplate, DateClock

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML_TEMPLATE}
"""Templates usable by name with ``--template`` (for tokenizers that ship none)."""


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tokenizer``, ``--template``, ``--template-name``, ``--model-revision``, ``--now``,
    ``--block-size``."""
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="a tokenizer directory (tokenizer.json + tokenizer_config.json) or one of: "
        + ", ".join(NAMED_TOKENIZERS),
    )
    parser.add_argument(
        "--template",
        help="chat template file (.jinja) overriding the tokenizer's own, or 'chatml'",
    )
    parser.add_argument(
        "--template-name", help="which of the tokenizer's named templates (e.g. tool_use)"
    )
    parser.add_argument("--model-revision", default="", help="model revision to record")
    parser.add_argument(
        "--now",
        help="the time strftime_now renders (ISO 8601, e.g. 2025-01-31T09:00:00); "
        "default: the current time",
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
        help="cache block size (vLLM: 16)",
    )


@dataclass(frozen=True, slots=True)
class PromptSetup:
    bundle: TokenizerBundle
    template: ChatTemplate | None
    revisions: Revisions
    template_label: str


def clock_from(args: argparse.Namespace) -> DateClock:
    if args.now is None:
        return datetime.now
    try:
        fixed = datetime.fromisoformat(args.now)
    except ValueError:
        raise ConfigError(f"--now {args.now!r} is not an ISO 8601 time") from None
    return lambda: fixed


def require_lint_extra() -> None:
    """Rendering and tokenizing need the ``lint`` extra; say so instead of a traceback."""
    try:
        import jinja2  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"the prompt tools need the 'lint' extra ({exc.name} is missing): "
            "pip install 'kvreuse[lint]'"
        ) from None


def setup_prompts(args: argparse.Namespace) -> PromptSetup:
    require_lint_extra()
    bundle = load_tokenizer(args.tokenizer)
    clock = clock_from(args)
    override: str | None = None
    label = "template"
    if args.template is not None:
        if args.template in BUILTIN_TEMPLATES:
            override, label = BUILTIN_TEMPLATES[args.template], args.template
        else:
            if not Path(args.template).exists():
                raise ConfigError(
                    f"--template {args.template}: no such file (or use one of "
                    f"{', '.join(BUILTIN_TEMPLATES)})"
                )
            data = read_bytes(args.template, "--template")
            override, label = utf8_text(data, args.template), args.template
    template: ChatTemplate | None = None
    if override is not None or bundle.templates:
        template = bundle.chat_template(override=override, name=args.template_name, clock=clock)
        if override is None:
            label = f"{bundle.source}: chat_template ({template.name})"
    revisions = Revisions(
        tokenizer=bundle.tokenizer.revision,
        template=template.revision if template is not None else "",
        model=args.model_revision,
    )
    return PromptSetup(bundle, template, revisions, label)


def _unwrap(value: object) -> object:
    if isinstance(value, Mapping) and "messages" not in value and "prompt" not in value:
        for key in ("body", "request"):
            if isinstance(value.get(key), Mapping):
                return value[key]
    return value


def read_requests(path_text: str) -> list[tuple[str, Mapping[str, Any] | str]]:
    """(label, request or raw text) for every request in a file. Malformed input (not UTF-8,
    not JSON, nested too deeply, oversized numbers, lone surrogates) raises
    :class:`InputFormatError` naming the file, the line and the field."""
    data = read_bytes(path_text, "request file")
    path = Path(path_text)
    if path.suffix == ".jsonl":
        out: list[tuple[str, Mapping[str, Any] | str]] = []
        for number, line in enumerate(data.split(b"\n"), start=1):
            if not line.strip():
                continue
            where = f"{path_text}:{number}"
            value = _unwrap(parse_json(line, where))
            if not isinstance(value, Mapping):
                raise InputFormatError("each line must be a request object", where=where)
            out.append((where, value))
        return out
    if path.suffix == ".json":
        value = parse_json(data, path_text)
        items = value if isinstance(value, list) else [value]
        result: list[tuple[str, Mapping[str, Any] | str]] = []
        for index, item in enumerate(items):
            item = _unwrap(item)
            where = path_text if len(items) == 1 else f"{path_text}[{index}]"
            if not isinstance(item, Mapping):
                raise InputFormatError("a request must be a JSON object", where=where)
            result.append((where, item))
        return result
    return [(path_text, utf8_text(data, path_text, "UTF-8 text"))]


def load_prompts(paths: list[str], setup: PromptSetup) -> list[Prompt]:
    """Every request of ``paths`` rendered and tokenized, in file order. A request log takes
    about 1 ms a request, so the count so far is shown on stderr (stdout may be the report)."""
    from kvreuse.lint.prompt import build_prompt

    requests = [item for path in paths for item in read_requests(path)]
    if not requests:
        raise ConfigError("no requests found in the given files")
    prompts = []
    with progress_bar(make_console(stderr=True)) as progress:
        task = progress.add_task("rendering and tokenizing", total=len(requests))
        for label, request in requests:
            prompts.append(
                build_prompt(
                    request,
                    tokenizer=setup.bundle.tokenizer,
                    template=setup.template,
                    label=label,
                )
            )
            progress.update(task, advance=1)
    return prompts


def write_output(text: str, output: str | None) -> None:
    if output is None:
        print(text)
        return
    write_whole(Path(output), text + "\n", "--output")
