"""The HTML report of ``kvreuse simulate --report``: one self-contained page, PNG plots inline.

Plots: token hit rate and p95 TTFT per run; prefill load per replica; hit rate over time (a
timestamp step shows here); TTFT by prompt-length band; the spill-threshold sweep.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreuse import defaults
from kvreuse.cli.files import write_whole
from kvreuse.errors import ConfigError
from kvreuse.sim.runner import ScenarioRun, check
from kvreuse.sim.scenarios import Scenario
from kvreuse.sim.summary import hit_rate_over_time, load_per_replica, ttft_by_band
from kvreuse.sim.trace import Bounds


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--report needs matplotlib: pip install 'kvreuse[report]'"
        ) from None
    return plt


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def report_page(title: str, body: str, cells: str = "td,th") -> str:
    """The reports' self-contained HTML page: ``title`` (escaped here) and ``body`` (HTML) in
    the shared style; ``cells`` selects the bordered table cells."""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:auto}}
{cells}{{border:1px solid #ccc;padding:2px 6px;font-size:13px}}table{{border-collapse:collapse}}
img{{max-width:100%}}</style></head><body>{body}</body></html>
"""


def figures_html(images: Sequence[tuple[str, str]]) -> str:
    """Each ``(title, base64 PNG)`` as a heading and its inline image."""
    esc = html.escape
    return "".join(
        f"<h2>{esc(title)}</h2><img alt='{esc(title)}' src='data:image/png;base64,{data}'>"
        for title, data in images
    )


def _labels(rows: Sequence[ScenarioRun]) -> list[str]:
    from kvreuse.cli.simulate import run_label

    return [run_label(r) for r in rows]


def _per_policy(plt: Any, rows: Sequence[ScenarioRun]) -> str:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    labels = _labels(rows)
    left.barh(labels, [r.summary.token_hit_rate * 100 for r in rows], color="tab:green")
    left.set_xlabel("token hit rate (%)")
    right.barh(labels, [r.summary.ttft_p95_s for r in rows], color="tab:orange")
    right.set_xlabel("p95 TTFT (s)")
    right.set_yticklabels([])
    fig.suptitle("hit rate and p95 TTFT per run")
    return _png(fig)


def _load(plt: Any, rows: Sequence[ScenarioRun]) -> Any:
    """Grouped bars: one group per replica, one bar per run, the tick under each group's
    middle and the legend outside the plot, so no bar hides under it."""
    fig, ax = plt.subplots(figsize=(12, 4.5))
    count = max(len(rows), 1)
    width = 0.8 / count
    widest = max((r.spec.replicas for r in rows), default=1)
    for i, row in enumerate(rows):
        loads = load_per_replica(row.run)
        xs = [k - 0.4 + (i + 0.5) * width for k in range(len(loads))]
        ax.bar(xs, loads, width, label=_labels([row])[0])
    ax.set_xticks(range(widest))
    ax.set_xticklabels([f"replica {k + 1}" for k in range(widest)])
    ax.set_xlim(-0.5, widest - 0.5)
    ax.set_xlabel("replica")
    ax.set_ylabel("prefill GPU-seconds (measured requests)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title("load per replica")
    return fig


def _over_time(plt: Any, rows: Sequence[ScenarioRun]) -> str:
    fig, ax = plt.subplots(figsize=(12, 4))
    for row in rows:
        points = hit_rate_over_time(row.run, 2.0)
        ax.plot([p.start_s for p in points], [p.token_hit_rate * 100 for p in points],
                label=_labels([row])[0])
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("token hit rate (%)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title("hit rate over time (2 s buckets)")
    return _png(fig)


def _bands(plt: Any, rows: Sequence[ScenarioRun]) -> Any:
    """Bands are categories, not a scale: grouped bars per band, no line drawn between them."""
    fig, ax = plt.subplots(figsize=(12, 4.5))
    per_row = [ttft_by_band(row.run) for row in rows]
    bands = list(dict.fromkeys(p.band for points in per_row for p in points))
    count = max(len(rows), 1)
    width = 0.8 / count
    for i, (row, points) in enumerate(zip(rows, per_row, strict=True)):
        by_band = {p.band: p.ttft_p95_s for p in points}
        xs = [k - 0.4 + (i + 0.5) * width for k, band in enumerate(bands) if band in by_band]
        ax.bar(xs, [by_band[b] for b in bands if b in by_band], width, label=_labels([row])[0])
    ax.set_xticks(range(len(bands)))
    ax.set_xticklabels(bands)
    ax.set_xlabel("prompt length band (tokens)")
    ax.set_ylabel("p95 TTFT (s)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title("p95 TTFT by prompt-length band")
    return fig


def _sweep(plt: Any, rows: Sequence[ScenarioRun]) -> str:
    fig, left = plt.subplots(figsize=(12, 4))
    points = []
    for row in rows:
        options = dict(row.spec.options)
        spill = float(options.get("spill_threshold_s", math.inf))
        points.append((spill, row.summary))
    finite = [p for p, _ in points if math.isfinite(p)]
    top = (max(finite) * 2) if finite and max(finite) > 0 else 1.0
    xs = [p if math.isfinite(p) else top for p, _ in points]
    names = [f"{p:g}" if math.isfinite(p) else "inf" for p, _ in points]
    left.plot(range(len(xs)), [s.ttft_p95_s for _, s in points], marker="o", color="tab:orange")
    left.set_ylabel("p95 TTFT (s)", color="tab:orange")
    left.set_xticks(range(len(xs)))
    left.set_xticklabels(names)
    left.set_xlabel("spill threshold (s)")
    right = left.twinx()
    right.plot(range(len(xs)), [s.token_hit_rate * 100 for _, s in points], marker="s",
               color="tab:green")
    right.set_ylabel("token hit rate (%)", color="tab:green")
    left.set_title(f"spill-threshold sweep ({rows[0].spec.policy} x{rows[0].spec.replicas})")
    return _png(fig)


def _knob_curve(plt: Any, rows: Sequence[ScenarioRun]) -> str:
    """relative_spill's trade-off: token hit rate against p95 TTFT, one point per slack."""
    fig, ax = plt.subplots(figsize=(12, 4))
    hits = [row.summary.token_hit_rate * 100 for row in rows]
    p95s = [row.summary.ttft_p95_s for row in rows]
    ax.plot(hits, p95s, marker="o", color="tab:blue")
    for row, x, y in zip(rows, hits, p95s, strict=True):
        slack = float(dict(row.spec.options).get("slack", math.inf))
        ax.annotate(f"slack {slack:g}" if math.isfinite(slack) else "slack inf", (x, y),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("token hit rate (%)")
    ax.set_ylabel("p95 TTFT (s)")
    ax.set_title(f"relative_spill's knob: hit rate vs p95 as slack varies "
                 f"(x{rows[0].spec.replicas}; rightwards: more affinity)")
    return _png(fig)


@dataclass(frozen=True, slots=True)
class LabLinks:
    """How the report's runs map onto ``kvreuse lab``: where it serves, and the flags that
    change a run the way the lab's controls can (or cannot: ``showable=False``)."""

    base_url: str = defaults.lab_base_url()
    scale: float = 1.0
    cache_tokens: int | None = None
    scheduling: str | None = None
    showable: bool = True


def _lab_link(scenario: Scenario, row: ScenarioRun, seed: int, links: LabLinks) -> str:
    """An anchor to the lab's view of this run, or a dash when the lab cannot show it."""
    from kvreuse.web.links import lab_url_for_run

    spec = row.spec
    url = None
    if links.showable:
        pool = row.run.config.replica.pool_tokens
        url = lab_url_for_run(
            scenario.name, spec.policy, spec.replicas, seed=seed, variant=spec.variant,
            options=dict(spec.options), cache_tokens=links.cache_tokens or pool,
            scale=links.scale, scheduling=links.scheduling, base_url=links.base_url,
        )
    return f"<a href='{html.escape(url)}'>open in lab</a>" if url else "-"


def write_report(
    path: Path,
    scenario: Scenario,
    rows: Sequence[ScenarioRun],
    every_bounds: Sequence[Bounds],
    sweep: Sequence[ScenarioRun],
    parameters: dict[str, Any],
    *,
    seed: int = defaults.SEED,
    links: LabLinks | None = None,
    changed: Sequence[str] = (),
    knob: Sequence[ScenarioRun] = (),
    plotted: Sequence[ScenarioRun] | None = None,
) -> None:
    """Render and write the page. Raises :class:`ConfigError` without matplotlib or when the
    file cannot be written. ``knob``: relative_spill's runs over its slack values, plotted as
    its hit rate / p95 curve. ``plotted``: the rows the plots draw (default all; the no-cache
    baselines stay in the table only, their queueing would flatten every other bar).

    Each run links to the same run in ``kvreuse lab`` (at ``links.base_url``) where the lab can
    show it; ``changed`` are the reasons a figure may leave its stated range."""
    from kvreuse.cli.simulate import bounds_text, verdict_reason

    links = links or LabLinks()
    plt = _pyplot()
    drawn = list(plotted) if plotted else list(rows)
    images = [
        ("Hit rate and p95 TTFT per policy", _per_policy(plt, drawn)),
        ("Load per replica", _png(_load(plt, drawn))),
        ("Hit rate over time", _over_time(plt, drawn)),
        ("TTFT by prompt-length band", _png(_bands(plt, drawn))),
    ]
    if sweep:
        images.append(("Spill-threshold sweep", _sweep(plt, sweep)))
    if knob:
        images.append(("relative_spill: hit rate vs p95 TTFT as slack varies",
                       _knob_curve(plt, knob)))
    plt.close("all")
    esc = html.escape
    table_rows = "".join(
        "<tr>" + "".join(f"<td>{esc(str(v))}</td>" for v in (
            r.spec.label, r.spec.replicas, f"{r.summary.token_hit_rate:.1%}",
            f"{r.summary.request_hit_rate:.1%}", f"{r.summary.prefill_gpu_s_per_1k:.1f}",
            f"{r.summary.ttft_p50_s:.3f}", f"{r.summary.ttft_p95_s:.3f}",
            f"{r.summary.max_over_mean_load:.2f}", f"{r.summary.evicted_tokens:,}",
            r.summary.requests,
        )) + f"<td>{_lab_link(scenario, r, seed, links)}</td></tr>"
        for r in rows
    )
    verdicts = "".join(
        f"<li>{'in range' if v.ok else '<b>OUT OF RANGE</b>'}: {esc(v.expectation.policy)} "
        f"x{v.expectation.replicas} {esc(v.expectation.variant)} {esc(v.expectation.metric)} = "
        f"{v.value:.3g} (range {v.expectation.low:g}-{v.expectation.high:g}; "
        f"{esc(v.expectation.source)})"
        + ("" if v.ok else f": {esc(verdict_reason(v, changed))}")
        + "</li>"
        for v in check(scenario, rows)
    )
    stated = scenario.parameters()
    params = "".join(
        f"<tr><td>{esc(p.name)}</td><td>{esc(str(parameters.get(p.name, p.value)))}</td><td>"
        + (esc(p.source) if parameters.get(p.name, p.value) == stated[p.name]
           else f"given on the command line (the scenario's {esc(str(p.value))}: "
           f"{esc(p.source)})")
        + "</td></tr>"
        for p in scenario.params
    ) + "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(str(v))}</td><td>given on the command line</td></tr>"
        for k, v in parameters.items() if k not in stated
    ) if scenario.params else "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(str(v))}</td><td></td></tr>" for k, v in parameters.items()
    )
    page = report_page(f"kvreuse simulate: {scenario.name}", f"""
<h1>{esc(scenario.name)}</h1><p>{esc(scenario.summary)}</p>
<table><tr><th>run</th><th>replicas</th><th>token hit</th><th>request hit</th>
<th>prefill GPU-s/1k</th><th>TTFT p50 s</th><th>TTFT p95 s</th><th>max/mean load</th>
<th>evicted tokens</th><th>requests</th><th>lab</th></tr>{table_rows}</table>
<p>Lab links open the same run in <code>kvreuse lab</code> at
<code>{esc(links.base_url)}</code>: start it first (<code>kvreuse lab</code>; for another
address, <code>kvreuse lab --port N</code> and <code>kvreuse simulate --lab-url
http://127.0.0.1:N/</code>).</p>
<p>Hit-rate references: {"<br>".join(esc(line) for line in bounds_text(every_bounds))}</p>
<ul>{verdicts}</ul>{figures_html(images)}
<h2>Parameters</h2><table><tr><th>name</th><th>value</th><th>source</th></tr>{params}</table>
""")
    write_whole(path, page, "--report")
