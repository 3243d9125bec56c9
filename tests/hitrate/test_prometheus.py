"""Prometheus parsing and prefix-cache counter extraction for vLLM and SGLang pages."""

from __future__ import annotations

import pytest

from kvreuse.errors import InputFormatError
from kvreuse.hitrate.prometheus import cache_counters, parse_exposition
from kvreuse.testing.prometheus import sglang_page, vllm_page


def test_parses_labels_escapes_and_special_values() -> None:
    """Quoted label values with escapes, NaN/Inf values and timestamps parse."""
    samples = parse_exposition(
        '# HELP x help\n# TYPE x gauge\nx{a="q\\"uote",b="back\\\\slash"} 1.5 1700000000\n'
        "y NaN\nz +Inf\n# EOF\n"
    )
    assert samples[0].labels == (("a", 'q"uote'), ("b", "back\\slash"))
    assert samples[0].value == 1.5
    assert samples[2].value == float("inf")


def test_bad_line_names_its_line_number() -> None:
    """A malformed sample is an InputFormatError with the line number."""
    with pytest.raises(InputFormatError, match="line 2"):
        parse_exposition("ok 1\nbroken line here\n", "page")


def test_only_keeps_the_named_samples() -> None:
    """only= keeps samples of exactly those names; a longer name sharing the prefix is not one,
    and the lines it skips are not checked."""
    page = "a_total 1\na_total_extra 2\nb 3\nnot a sample at all\na_total{x=\"y\"} 4\n"
    samples = parse_exposition(page, only=("a_total",))
    assert [(s.name, s.value) for s in samples] == [("a_total", 1.0), ("a_total", 4.0)]


def test_lenient_parse_skips_malformed_lines() -> None:
    """strict=False drops a line with a bad value or bad labels and keeps the rest."""
    page = 'x 1\nx abc\nx{a=unquoted} 2\nx{a="ok"} 3\ngarbage\n'
    samples = parse_exposition(page, strict=False)
    assert [(s.name, s.labels, s.value) for s in samples] == [
        ("x", (), 1.0), ("x", (("a", "ok"),), 3.0)]


@pytest.mark.parametrize("suffix", [True, False])
def test_vllm_counters_with_and_without_total_suffix(suffix: bool) -> None:
    """vLLM's counters are found with or without _total, summed over engines."""
    counters = cache_counters(parse_exposition(vllm_page(300.0, 1000.0, engines=2, suffix=suffix)))
    assert counters is not None
    assert (counters.family, counters.hits, counters.queries) == ("vllm", 300.0, 1000.0)


def test_older_vllm_gpu_prefix_cache_names() -> None:
    """Older vLLM releases' vllm:gpu_prefix_cache_* counters are understood."""
    counters = cache_counters(parse_exposition(vllm_page(5.0, 20.0, legacy_gpu_names=True)))
    assert counters is not None and counters.family == "vllm-gpu"
    assert counters.hits == 5.0


def test_created_samples_are_not_counted() -> None:
    """prometheus_client's *_created timestamps never enter the sums."""
    counters = cache_counters(parse_exposition(vllm_page(1.0, 2.0)))
    assert counters is not None and counters.queries == 2.0


def test_sglang_cached_tokens_summed_over_cache_sources() -> None:
    """SGLang's cached tokens (device + host) over prompt tokens; the gauge is ignored."""
    counters = cache_counters(parse_exposition(sglang_page(400.0, 1000.0)))
    assert counters is not None
    assert (counters.family, counters.hits, counters.queries) == ("sglang", 400.0, 1000.0)


def test_underscore_exporters_and_model_filter() -> None:
    """Names with ':' rewritten to '_' match; --model keeps one model's series."""
    page = (
        'vllm_prefix_cache_hits_total{model_name="a"} 1\n'
        'vllm_prefix_cache_queries_total{model_name="a"} 4\n'
        'vllm_prefix_cache_hits_total{model_name="b"} 9\n'
        'vllm_prefix_cache_queries_total{model_name="b"} 10\n'
    )
    samples = parse_exposition(page)
    assert cache_counters(samples, model="a") == cache_counters(samples, model="a")
    only_a = cache_counters(samples, model="a")
    assert only_a is not None and (only_a.hits, only_a.queries) == (1.0, 4.0)
    both = cache_counters(samples)
    assert both is not None and (both.hits, both.queries) == (10.0, 14.0)


def test_gauge_only_engines_give_their_rate() -> None:
    """An engine with only sglang:cache_hit_rate reports that gauge."""
    counters = cache_counters(parse_exposition('sglang:cache_hit_rate{model_name="m"} 0.25\n'))
    assert counters is not None and counters.gauge_rate == 0.25 and counters.hits is None


def test_page_without_cache_metrics() -> None:
    """A page with no prefix-cache metric gives None."""
    assert cache_counters(parse_exposition("process_cpu_seconds_total 3\n")) is None


def test_page_written_by_prometheus_client_as_vllm_does() -> None:
    """vLLM registers prometheus_client Counters named vllm:prefix_cache_{queries,hits} with
    model_name and engine labels; the page that client writes (_total, _created) parses."""
    import prometheus_client  # the gateway extra, installed with kvreuse[all]
    registry = prometheus_client.CollectorRegistry()
    labels = ["model_name", "engine"]
    queries = prometheus_client.Counter(
        "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
        labelnames=labels, registry=registry,
    )
    hits = prometheus_client.Counter(
        "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
        labelnames=labels, registry=registry,
    )
    for engine, (q, h) in enumerate([(1000, 250), (3000, 2250)]):
        queries.labels("llama", str(engine)).inc(q)
        hits.labels("llama", str(engine)).inc(h)
    page = prometheus_client.generate_latest(registry).decode()
    assert "vllm:prefix_cache_queries_total" in page and "_created" in page
    counters = cache_counters(parse_exposition(page), model="llama")
    assert counters is not None
    assert (counters.hits, counters.queries) == (2500.0, 4000.0)
