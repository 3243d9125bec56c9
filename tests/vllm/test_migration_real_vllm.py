"""Stream migration on real vLLM: a stream cut mid-answer on one replica is finished by the
other, and with greedy decoding the client gets the answer an unbroken stream gives.

Replica 0 sits behind a :class:`kvreuse.testing.cutter.CuttingProxy` that closes the
connection after a few events, as a killed engine does; replica 1 behind a pass-through one
that keeps the continuation request it was sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvreuse.gateway.config import UpstreamConfig
from kvreuse.testing.cutter import CuttingProxy

from .conftest import LiveGateway
from .test_real_vllm import text
from .vllm_fleet import MODEL_NAME, Replica

StartGateway = Callable[..., LiveGateway]


def streamed(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = httpx.post(url + path, json={"model": MODEL_NAME, "stream": True,
                                            "temperature": 0, "ignore_eos": True,
                                            "stream_options": {"include_usage": True}, **body},
                          timeout=120)
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text
    assert all('"error"' not in event for event in events), response.text
    return [json.loads(event) for event in events[:-1]]


def pieces(events: list[dict[str, Any]], kind: str) -> list[str]:
    """The text of each output event (a chat's role announcement is not one)."""
    out = []
    for event in events:
        for choice in event["choices"]:
            if kind == "completion":
                out.append(choice["text"])
            elif "role" not in choice["delta"]:
                out.append(choice["delta"].get("content") or "")
    return out


def output(events: list[dict[str, Any]], kind: str) -> str:
    return "".join(pieces(events, kind))


@pytest.mark.parametrize(("kind", "path"), [
    ("completion", "/v1/completions"),
    ("chat", "/v1/chat/completions"),
])
def test_streams_cut_on_one_vllm_are_finished_by_the_other(
        gateway_for: StartGateway, replicas: list[Replica], kind: str, path: str) -> None:
    """Ten prompts, each cut after 6 events on replica 0: every client stream has all 16
    tokens, one id, usage of 16 completion tokens, and the unbroken answer's text up to the
    cut; replica 1 was asked to continue exactly the text sent. Prints how many migrated
    answers equal the unbroken ones under greedy decoding (text is re-tokenized at the cut,
    so a cut inside a word can continue differently)."""
    import sys

    tokens, cut_after, same = 16, 6, 0
    for _ in range(10):
        body: dict[str, Any] = ({"prompt": text(40)} if kind == "completion" else
                                {"messages": [{"role": "user", "content": text(30)}]})
        whole = streamed(replicas[1].url, path, {**body, "max_tokens": tokens})
        with CuttingProxy(replicas[0].url, cut_after=cut_after) as cut, \
                CuttingProxy(replicas[1].url, cut_after=10**6) as watcher:
            gateway = gateway_for(upstreams=(
                UpstreamConfig(cut.url, name="cut"),
                UpstreamConfig(watcher.url, name="watched")), policy="round_robin")
            events = streamed(gateway.url, path, {**body, "max_tokens": tokens})
            assert cut.cuts == 1
            continuation = watcher.bodies[-1]
        assert len({event["id"] for event in events}) == 1
        assert events[-1]["usage"]["completion_tokens"] == tokens
        got, expected = output(events, kind), output(whole, kind)
        if kind == "completion":
            sent = continuation["prompt"][len(body["prompt"]):]
            assert continuation["prompt"].startswith(body["prompt"])
        elif "continue_final_message" in continuation:
            assert continuation["continue_final_message"] is True
            assert continuation["messages"][:-1] == body["messages"]
            assert continuation["messages"][-1]["role"] == "assistant"
            sent = continuation["messages"][-1]["content"]
        else:
            # Nothing with text was sent before the cut: the continuation is the question
            # itself, asked again with the tokens left.
            assert continuation["messages"] == body["messages"]
            assert not "".join(pieces(events, kind)[:cut_after - 1])
            sent = ""
        # The tiny random model's first tokens may carry no text (bytes the detokenizer
        # holds back): then nothing is appended, and the continuation regenerates them.
        assert got.startswith(sent) and expected.startswith(sent)
        # The cut came after cut_after events (the chat's first is its role announcement);
        # the last of them that carried no text are asked for again.
        sent_pieces = pieces(events, kind)[:cut_after - (kind == "chat")]
        trailing = next((i for i, piece in enumerate(reversed(sent_pieces)) if piece),
                        len(sent_pieces))
        assert continuation["max_tokens"] == tokens - len(sent_pieces) + trailing
        same += got == expected
    print(f"{kind}: {same} of 10 migrated answers equal the unbroken one", file=sys.stderr)
