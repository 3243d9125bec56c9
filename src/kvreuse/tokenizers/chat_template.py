"""Chat templates rendered exactly as Hugging Face transformers' ``apply_chat_template`` does.

The environment is transformers' own: a jinja2 ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag,
a ``tojson`` filter that neither escapes HTML nor sorts keys (``ensure_ascii=False``, with
``indent``, ``separators`` and ``sort_keys`` options), and the globals ``raise_exception`` and
``strftime_now``. Render variables are ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the tokenizer's named special tokens (``bos_token``, ``eos_token``,
...) and any extra keyword, which overrides a special token of the same name.

The renderer reads no clock of its own: ``strftime_now`` calls the injected clock, and a template
that calls it without one fails with a message saying so. The byte-for-byte equality with
transformers is proven in ``tests/tokenizers/test_chat_template_hf_equality.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvreuse.errors import ConfigError, InputFormatError, KvreuseError

DateClock = Callable[[], datetime]
"""What ``strftime_now`` reads: the current local time (``kvreuse.index.Clock`` is seconds)."""


class TemplateRaised(InputFormatError):
    """The chat template itself rejected the request (its ``raise_exception`` was called)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it for
    training masks; rendering emits the body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API declares it a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_emit"), [], [], body).set_lineno(lineno)

    def _emit(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and sorts keys; transformers replaces it with this.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _clockless_strftime_now(format: str) -> str:
    raise ConfigError(
        "this chat template calls strftime_now (it puts the current date or time into the "
        "prompt); pass a clock to ChatTemplate (the CLI passes the wall clock)"
    )


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _clockless_strftime_now
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(
            f"chat template syntax error on line {exc.lineno}: {exc.message}"
        ) from None


def template_revision(source: str) -> str:
    """Hex sha256 of a template's source: the template revision fingerprints record."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


class ChatTemplate:
    """One chat template, compiled once, rendered per request.

    ``special_tokens`` are the tokenizer's named special tokens (``bos_token`` ...); ``clock``
    feeds ``strftime_now``. Instances are immutable and safe to share between threads.
    """

    __slots__ = ("_clock", "_special_tokens", "_template", "name", "revision", "source")

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        clock: DateClock | None = None,
        name: str = "",
    ) -> None:
        self.source = source
        self.name = name
        self.revision = template_revision(source)
        self._special_tokens = dict(special_tokens or {})
        self._clock = clock
        self._template = _compile(source)

    def with_clock(self, clock: DateClock | None) -> ChatTemplate:
        """The same template reading another clock (audits render at two instants)."""
        return ChatTemplate(
            self.source, special_tokens=self._special_tokens, clock=clock, name=self.name
        )

    @property
    def special_tokens(self) -> Mapping[str, str]:
        return dict(self._special_tokens)

    @property
    def reads_clock(self) -> bool:
        """Whether rendering may depend on the time (it references ``strftime_now``)."""
        return "strftime_now" in _referenced_names(self.source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text, identical to ``apply_chat_template(..., tokenize=False)``.

        Raises :class:`TemplateRaised` when the template rejects the messages and
        :class:`~kvreuse.errors.InputFormatError` for inputs transformers also refuses.
        """
        if not messages:
            raise InputFormatError("a chat needs at least one message", where="messages")
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and (not isinstance(value, Sequence)
                                      or isinstance(value, (str, bytes))):
                raise InputFormatError(f"{name} must be an array", name)
        if tools is not None:
            for index, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise InputFormatError("a tool must be a JSON schema object", f"tools[{index}]")
        if documents is not None:
            for index, document in enumerate(documents):
                if not isinstance(document, Mapping):
                    raise InputFormatError(
                        "a document must be an object with 'title' and 'text'",
                        f"documents[{index}]",
                    )
        context: dict[str, Any] = {**self._special_tokens, **kwargs}
        if self._clock is not None and "strftime_now" not in kwargs:
            clock = self._clock
            context["strftime_now"] = lambda format: clock().strftime(format)
        try:
            return self._template.render(
                messages=messages,
                tools=None if tools is None else list(tools),
                documents=None if documents is None else list(documents),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except KvreuseError:
            raise
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateRaised(f"the chat template refused this request: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError,
                RecursionError) as exc:
            # transformers lets these escape; they mean the request lacks what the template needs
            # (or the template cannot handle it: the sandbox's too-large range is an
            # OverflowError, a division by a field that is 0 a ZeroDivisionError)
            raise TemplateRaised(
                f"the chat template failed on this request ({type(exc).__name__}: {exc}); "
                "check the fields it expects (tools, roles, content types)"
            ) from None


@lru_cache(maxsize=64)
def _referenced_names(source: str) -> frozenset[str]:
    """Every name the template loads, globals included (jinja2.meta leaves globals out)."""
    parsed = _compile(source).environment.parse(source)
    return frozenset(node.name for node in parsed.find_all(jinja2.nodes.Name))


def select_template(
    templates: Mapping[str, str], *, tools: object = None, name: str | None = None
) -> str:
    """Pick a template source as transformers' ``get_chat_template`` does.

    A named template when asked; otherwise ``tool_use`` if tools are given and it exists, else
    ``default``.
    """
    if name is not None:
        if name not in templates:
            raise ConfigError(
                f"no chat template named {name!r}; this tokenizer has {sorted(templates)}"
            )
        return templates[name]
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if not templates:
        raise ConfigError("this tokenizer has no chat template; pass --template FILE")
    raise ConfigError(f"several chat templates and no default; choose one of {sorted(templates)}")
