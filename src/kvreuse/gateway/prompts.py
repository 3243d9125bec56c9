"""Prompt token ids as the engine will see them, fast enough to route on.

Two implementations of :class:`PromptTokenizer`:

* :class:`HFPromptTokenizer` (``--tokenizer DIR``): renders chats with the directory's chat
  template (jinja2 sandbox, transformers' semantics, via :mod:`kvreuse.tokenizers`) and tokenizes
  with Hugging Face ``tokenizers``, as vLLM does: completions with ``add_special_tokens=True``
  (the post-processor's BOS), chats with ``add_special_tokens=False`` (the template emits BOS).
  Tokenization is memoized at special-token boundaries: ``tokenizers`` itself first splits text
  at its non-normalized added tokens and encodes each piece on its own, so encoding the pieces
  separately gives the same ids, and a chat whose history was seen costs about one new message.
* :class:`TextApproximation` (no tokenizer): **one pseudo-token per 4 bytes of UTF-8**, the
  token id being those 4 bytes read as a little-endian uint32 (the last one zero-padded). It
  keeps the two properties routing needs: equal text prefixes give equal token prefixes (all but
  the last partial token), and lengths are close to BPE's ~4 characters per token for English.
  Chats are flattened as ``<|role|>\\n{content}\\n`` per message, plus ``<|assistant|>\\n`` when
  a generation prompt is asked for. ``kvreuse engine`` without a tokenizer uses the very same
  function, so a gateway in front of it predicts cached tokens exactly.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.tokenizers.contract import special_pattern
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer, pack

if TYPE_CHECKING:
    from kvreuse.gateway.validation import ParsedRequest

Messages = Sequence[Mapping[str, Any]]

GIL_FREE_CHARS = 65_536
"""Texts at least this long are encoded through ``tokenizers``' ``encode_batch_fast`` (before
0.20, ``encode_batch``), which releases the GIL while its Rust code runs; ``encode`` holds it.
Measured with the tiny Llama tokenizer on a 3 MB text: ``encode`` held every other Python thread
for 3.3 s (the event loop too, though the call ran on the gateway's tokenizing thread:
``kvreuse route`` answered no ``/health`` for 6.0 s on a 6 MB prompt, ``kvreuse engine``
6.3 s), ``encode_batch`` for 0.13 s (building the id list), with the same ids in the same time;
``encode_batch_fast``, which skips the offsets, gives them in 1.0 s instead of 2.5 s. Below the
threshold ``encode`` holds the GIL for at most ~20 ms, and stays, because ``tokenizers`` notes
any use of its thread pool and then warns in every process forked afterwards."""


class PromptTokenizer(Protocol):
    """Turns a request's prompt into the token ids the engine will prefill."""

    name: str
    blocking: bool
    """True when a call may hold the caller for long (a real tokenizer on a multi-megabyte
    chat: 13 s for 7 MB): the gateway and the engine then call it off their event loops, on
    :class:`WorkerLanes`' threads (so it must be safe to call from two threads at once)."""

    def completion(self, prompt: str) -> TokenBuffer:
        """Called per /v1/completions request with a text prompt. O(len(prompt))."""
        ...

    def chat(
        self,
        messages: Messages,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TokenBuffer:
        """Called per /v1/chat/completions request. With memoization, O(new text)."""
        ...


def message_text(content: object, where: str) -> str:
    """A message's ``content`` as the template sees it: a string, or text parts joined by
    newlines (vLLM's string content format). Non-text parts contribute nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise InputFormatError("a content part must be an object", f"{where}[{index}]")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InputFormatError("a text part needs a string 'text'",
                                           f"{where}[{index}].text")
                texts.append(text)
        return "\n".join(texts)
    raise InputFormatError("content must be a string or an array of parts", where)


def normalized_messages(messages: Messages) -> list[dict[str, Any]]:
    """Messages with string content, everything else passed to the template unchanged."""
    out = []
    for index, message in enumerate(messages):
        copy = dict(message)
        copy["content"] = message_text(message.get("content"), f"messages[{index}].content")
        out.append(copy)
    return out


def approximate_tokens(text: str) -> TokenBuffer:
    """The documented approximation: one token per 4 UTF-8 bytes. O(len(text))."""
    raw = text.encode("utf-8")
    pad = -len(raw) % TOKEN_BYTES
    return TokenBuffer(raw + b"\0" * pad if pad else raw)


def request_tokens(tokenizer: PromptTokenizer, parsed: ParsedRequest) -> TokenBuffer:
    """A validated request's prompt as the engine will tokenize it: token-id prompts as given,
    text through ``tokenizer``, chats rendered and tokenized. Shared by gateway and engine."""
    if parsed.kind == "completion":
        if isinstance(parsed.prompt, list):
            return pack(parsed.prompt)
        assert isinstance(parsed.prompt, str)
        return tokenizer.completion(parsed.prompt)
    return tokenizer.chat(
        parsed.messages,
        tools=parsed.tools,
        add_generation_prompt=parsed.add_generation_prompt,
        continue_final_message=parsed.continue_final_message,
        template_kwargs=parsed.template_kwargs,
    )


class TextApproximation:
    """Routing without a tokenizer; see the module docstring."""

    name = "approx-4-bytes"
    blocking = False  # a UTF-8 encode: 0.1 s for 8 MB

    def completion(self, prompt: str) -> TokenBuffer:
        return approximate_tokens(prompt)

    def chat(
        self,
        messages: Messages,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TokenBuffer:
        parts = []
        if tools:
            parts.append("<|tools|>\n" + json.dumps(list(tools), sort_keys=True) + "\n")
        for message in normalized_messages(messages):
            parts.append(f"<|{message.get('role', '')}|>\n{message['content']}\n")
        if continue_final_message and parts:
            parts[-1] = parts[-1][:-1]
        elif add_generation_prompt:
            parts.append("<|assistant|>\n")
        return approximate_tokens("".join(parts))


class HFPromptTokenizer:
    """A Hugging Face tokenizer directory; see the module docstring. Safe to call from several
    threads at once: the memo is locked for each lookup and insert, never while encoding."""

    blocking = True

    def __init__(self, directory: str | Path, *, memo_entries: int = 65_536,
                 memo_bytes: int = 64 * 1024 * 1024) -> None:
        from tokenizers import Tokenizer

        from kvreuse.tokenizers import load_tokenizer

        path = Path(directory)
        bundle = load_tokenizer(path)
        self.name = bundle.tokenizer.name
        self.revision = bundle.tokenizer.revision
        self._template = bundle.chat_template() if bundle.templates else None
        try:
            self._backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust library raises a bare Exception
            raise ConfigError(f"cannot load {path / 'tokenizer.json'}: {exc}") from None
        added = self._backend.get_added_tokens_decoder().values()
        splitters = [a.content for a in added if not a.normalized]
        # Boundaries are exact only for plain tokens; a stripping or single-word added token
        # changes where tokenizers splits, so memoization is then off (still correct, slower).
        self.memoized = not any(
            a.lstrip or a.rstrip or a.single_word for a in added if not a.normalized
        )
        self._pattern = special_pattern(splitters) if self.memoized else None
        probe = "\x00probe\x00"
        with_specials = self._backend.encode(probe, add_special_tokens=True).ids
        plain = self._backend.encode(probe, add_special_tokens=False).ids
        at = _find(with_specials, plain)
        self._prefix = pack(with_specials[:at])
        self._suffix = pack(with_specials[at + len(plain) :])
        # Without offsets (tokenizers >= 0.20): 1.0 s for 3 MB where encode_batch takes 2.5 s.
        self._encode_long = getattr(self._backend, "encode_batch_fast",
                                    self._backend.encode_batch)
        self._memo: OrderedDict[str, bytes] = OrderedDict()
        self._memo_lock = threading.Lock()
        self._memo_entries = memo_entries
        # Entries alone do not bound memory: 65,536 pieces of 4,000-token prompts are ~2 GB.
        self._memo_bytes = memo_bytes
        self._memo_size = 0  # characters + packed id bytes held
        self.memo_misses = 0
        if self._pattern is not None and splitters and not self._pieces_agree(splitters):
            # e.g. a Metaspace pre-tokenizer with prepend_scheme="first" treats the start of
            # the whole text differently from the start of a piece: no memo then.
            self.memoized = False
            self._pattern = None

    def _pieces_agree(self, splitters: list[str]) -> bool:
        """Whether piecewise encoding reproduces whole-text encoding on a probe chat."""
        special = splitters[-1]
        probe = f"{special}system\n Be brief.{special} user\nHi  there{special}\n x{special}"
        whole = self._backend.encode(probe, add_special_tokens=False).ids
        ok = pack(whole) == self.encode(probe)
        self._memo.clear()
        self._memo_size = 0
        self.memo_misses = 0
        return ok

    def encode(self, text: str) -> TokenBuffer:
        """Ids of ``text`` without post-processing (``add_special_tokens=False``)."""
        pattern = self._pattern
        if pattern is None:
            return pack(self._ids(text))
        pieces: list[bytes] = []
        memo = self._memo
        start = 0
        for match in pattern.finditer(text):
            if match.start() > start:
                pieces.append(self._piece(text[start : match.start()]))
            pieces.append(self._piece(match.group()))
            start = match.end()
        if start < len(text):
            pieces.append(self._piece(text[start:]))
        with self._memo_lock:
            while memo and (len(memo) > self._memo_entries
                            or self._memo_size > self._memo_bytes):
                piece, ids = memo.popitem(last=False)
                self._memo_size -= len(piece) + len(ids)
        return TokenBuffer(b"".join(pieces))

    def _piece(self, piece: str) -> bytes:
        with self._memo_lock:
            found = self._memo.get(piece)
            if found is not None:
                self._memo.move_to_end(piece)
                return found
            self.memo_misses += 1
        ids = pack(self._ids(piece))
        if len(piece) + len(ids) <= self._memo_bytes // 16:  # a giant piece would evict all
            with self._memo_lock:
                if piece not in self._memo:  # another thread may have encoded it meanwhile
                    self._memo[piece] = ids
                    self._memo_size += len(piece) + len(ids)
        return ids

    def check_invariants(self) -> None:
        """The memo's size is what it holds and within its bounds. O(memo)."""
        with self._memo_lock:
            held = sum(len(piece) + len(ids) for piece, ids in self._memo.items())
            assert held == self._memo_size, f"memo counts {self._memo_size}, holds {held}"
            assert len(self._memo) <= self._memo_entries, "memo over its entry bound"
            assert self._memo_size <= self._memo_bytes, "memo over its byte bound"

    def _ids(self, text: str) -> list[int]:
        """The ids of ``text`` without post-processing; see :data:`GIL_FREE_CHARS`."""
        if len(text) < GIL_FREE_CHARS:
            ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        else:
            ids = self._encode_long([text], add_special_tokens=False)[0].ids
        return ids

    def completion(self, prompt: str) -> TokenBuffer:
        return TokenBuffer(self._prefix + self.encode(prompt) + self._suffix)

    def render(
        self,
        messages: Messages,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM renders for a chat request."""
        if self._template is None:
            raise ConfigError(
                f"tokenizer {self.name} has no chat_template in tokenizer_config.json; "
                "chat requests cannot be rendered"
            )
        plain = normalized_messages(messages)
        options: dict[str, Any] = {
            "tools": tools,
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
        }
        extra = dict(template_kwargs or {})
        if "messages" in extra:
            raise InputFormatError(
                "chat_template_kwargs cannot set 'messages': send them as the request's "
                "messages", "chat_template_kwargs")
        options.update(extra)  # as vLLM: they override tools, documents, add_generation_prompt
        text = self._template.render(plain, **options)
        if continue_final_message and plain:
            # transformers: cut the rendering right after the final message's (stripped) text.
            final = str(plain[-1]["content"]).strip()
            at = text.rfind(final)
            if at < 0:
                raise InputFormatError(
                    "continue_final_message: the final message does not appear in the rendering",
                    "continue_final_message",
                )
            text = text[: at + len(final)]
        return text

    def chat(self, messages: Messages, **options: Any) -> TokenBuffer:
        """:meth:`render` (``options`` are its keyword arguments), then :meth:`encode`."""
        return self.encode(self.render(messages, **options))

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=True)
        return text


def _find(haystack: Sequence[int], needle: Sequence[int]) -> int:
    for start in range(len(haystack) - len(needle) + 1):
        if list(haystack[start : start + len(needle)]) == list(needle):
            return start
    raise ConfigError("cannot locate the post-processor's special tokens around a probe text")


def load_prompt_tokenizer(directory: str | Path | None) -> PromptTokenizer:
    """``--tokenizer DIR`` or, without one, the text approximation."""
    if directory is None:
        return TextApproximation()
    return HFPromptTokenizer(directory)
