"""The HTML report of ``kvreuse plan --report``: one self-contained page, PNG plots inline.

Plots: the first SLO's metric against replicas (each policy's best cell per fleet size, the
limit drawn across); prefill GPU time against replicas for every cell, the Pareto front and the
winner marked; token hit rate against cache size per policy.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from kvreuse.cli.files import write_whole
from kvreuse.cli.simreport import _png, _pyplot, figures_html, report_page
from kvreuse.sim.plan import CellResult, Slo


def _by_policy(results: Sequence[CellResult]) -> dict[str, list[CellResult]]:
    out: dict[str, list[CellResult]] = {}
    for r in results:
        out.setdefault(r.cell.policy, []).append(r)
    return out


def write_plan_report(
    path: Path,
    trace: str,
    slos: Sequence[Slo],
    results: Sequence[CellResult],
    front: Sequence[CellResult],
    winner: CellResult | None,
    command: str | None,
) -> None:
    """Render and write the page. Raises :class:`ConfigError` without matplotlib."""
    plt = _pyplot()
    metric = slos[0].metric
    groups = _by_policy(results)
    images = []

    fig, ax = plt.subplots(figsize=(10, 4))
    for policy, rows in groups.items():
        best: dict[int, float] = {}
        for r in rows:
            n = r.cell.replicas
            best[n] = min(best.get(n, r.metric(metric)), r.metric(metric))
        xs = sorted(best)
        ax.plot(xs, [best[x] for x in xs], marker="o", label=policy)
    ax.axhline(slos[0].limit_s, color="red", linestyle="--", label=f"SLO {slos[0]}")
    ax.set_xlabel("replicas")
    ax.set_ylabel(f"{metric} (s), best cell")
    ax.set_yscale("log")
    ax.legend()
    images.append((f"{metric} against replicas", _png(fig)))

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.scatter([r.cell.replicas for r in results], [r.prefill_gpu_s for r in results],
               color="lightgray", label="cells")
    ax.scatter([r.cell.replicas for r in front], [r.prefill_gpu_s for r in front],
               color="tab:blue", label="Pareto front")
    if winner is not None:
        ax.scatter([winner.cell.replicas], [winner.prefill_gpu_s], color="tab:red", s=120,
                   marker="*", label="winner")
    ax.set_xlabel("replicas")
    ax.set_ylabel("prefill GPU-seconds")
    ax.legend()
    images.append(("Prefill GPU time against replicas", _png(fig)))

    fig, ax = plt.subplots(figsize=(10, 4))
    for policy, rows in groups.items():
        best_hit: dict[int, float] = {}
        for r in rows:
            c = r.cell.cache_tokens
            best_hit[c] = max(best_hit.get(c, 0.0), r.token_hit_rate)
        xs = sorted(best_hit)
        ax.plot(xs, [best_hit[x] * 100 for x in xs], marker="o", label=policy)
    ax.set_xlabel("cache tokens per replica")
    ax.set_ylabel("token hit rate (%), best cell")
    ax.legend()
    images.append(("Token hit rate against cache size", _png(fig)))
    plt.close("all")

    esc = html.escape

    def row(r: CellResult) -> str:
        cell = r.cell
        knob = "" if cell.knob_name is None else f"{cell.knob_name}={cell.knob:g}"
        values = (cell.policy, knob, cell.replicas, f"{cell.cache_tokens:,}",
                  f"{r.token_hit_rate:.1%}", f"{r.prefill_gpu_s:,.1f}", f"{r.ttft_p50_s:.3f}",
                  f"{r.ttft_p95_s:.3f}", f"{r.ttft_p99_s:.3f}", f"{r.mean_queue_s:.3f}",
                  "meets" if r.meets(slos) else "misses")
        return "<tr>" + "".join(f"<td>{esc(str(v))}</td>" for v in values) + "</tr>"

    head = ("<tr><th>policy</th><th>knob</th><th>replicas</th><th>cache tokens</th>"
            "<th>token hit</th><th>prefill GPU-s</th><th>TTFT p50 s</th><th>TTFT p95 s</th>"
            "<th>TTFT p99 s</th><th>mean queue s</th><th>SLO</th></tr>")
    wanted = ", ".join(str(s) for s in slos)
    verdict = (
        f"<p><b>Winner</b> for {esc(wanted)}: {esc(winner.cell.key())}.</p>"
        f"<p>Reproduce: <code>{esc(command or '')}</code></p>"
        if winner is not None else f"<p><b>No cell meets {esc(wanted)}.</b></p>"
    )
    page = report_page(f"kvreuse plan: {trace}", f"""
<h1>kvreuse plan: {esc(trace)}</h1>{verdict}
<h2>Pareto front</h2><table>{head}{"".join(row(r) for r in front)}</table>
{figures_html(images)}
<h2>Every cell</h2><table>{head}{"".join(row(r) for r in results)}</table>
""")
    write_whole(path, page, "--report")
