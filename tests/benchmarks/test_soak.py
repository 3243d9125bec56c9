"""benchmarks/soak.py's reading of answers without usage."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_only_streams_the_gateway_cut_after_their_whole_answer_are_excused(
        bench: ModuleType) -> None:
    """An answer without usage is the engine's loss only if the gateway logged that cut."""
    log = ("2026-12-05 11:23:15,508 WARNING kvreuse.gateway.proxy: request soak-t1-3.250000: "
           "upstream engine2 failed after the whole answer was sent (ProtocolError), the "
           "stream is ended for it: closed the connection mid-response\n"
           "2026-12-05 11:23:16,000 WARNING kvreuse.gateway.proxy: request soak-t2-4.000000: "
           "upstream engine2 failed after the first byte (ProtocolError), continuing\n")
    missing = ["soak-t1-3.250000", "soak-t2-4.000000", "soak-t3-5.000000"]
    assert bench.usage_lost_with_engine(missing, log) == ["soak-t1-3.250000"]
    assert bench.usage_lost_with_engine(missing, "") == []


def test_request_ids_are_ones_the_gateway_keeps(bench: ModuleType) -> None:
    """The soak's ids are printable ASCII under 128 bytes, so the gateway logs them as sent."""
    call = bench.Call(12.3456789, "/v1/completions", b"{}", "t7", prompt_tokens=10)
    rid = bench.request_id_of(call)
    assert rid == "soak-t7-12.345679" and re.fullmatch(r"[\x21-\x7e]{1,128}", rid)
