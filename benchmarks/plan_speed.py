"""``kvreuse plan`` speed: a 48-cell plan over the Mooncake trace, on a process pool and on Ray.

Targets (issue 16): the 48-cell plan over ``../shared/data/mooncake_synthetic_trace.jsonl`` in
under 60 s on this 2-core machine (process pool, 2 workers); Ray with 2 workers at least 1.7×
faster than Ray with 1 (each timed as the whole command, a local Ray instance's start included).
The grid: round_robin, least_load, cache_aware (3 spill thresholds), exact (3) × replicas
8, 12, 16 × cache 200,000 and 400,000 tokens = 48 cells, none from the cache. The figures move
with whatever else shares the CPUs: the load average is printed before and after. Beside the Ray
verdict, for context, Ray's fixed cost (a one-cell plan) and the speed-up without it: since the
compiled core the 48 cells take about 9 CPU s, so Ray's ~6 s of start and stop bound the ratio
of whole commands near 1.5×.
Run: ``.venv/bin/python benchmarks/plan_speed.py [--skip-ray]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path

from kvreuse import native
from kvreuse.cli.main import main

TRACE = Path(__file__).resolve().parents[1] / "../shared/data/mooncake_synthetic_trace.jsonl"
GRID = ["--policy", "round_robin,least_load,cache_aware,exact", "--replicas", "8,12,16",
        "--cache-tokens", "200000,400000", "--slo", "ttft_p95=5"]
ONE_CELL = ["--policy", "round_robin", "--replicas", "8", "--cache-tokens", "200000",
            "--slo", "ttft_p95=5"]
TARGET_POOL_S = 60.0
TARGET_RAY_SPEEDUP = 1.7


def timed_plan(*extra: str, grid: list[str] = GRID) -> tuple[float, dict[str, object]]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "plan.json"
        argv = ["plan", "--trace", str(TRACE), *grid, "--no-cache", "--json", str(out), *extra]
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        wall = time.perf_counter() - start
        assert code == 0, f"kvreuse plan exited {code}"
        data: dict[str, object] = json.loads(out.read_text())
    return wall, data


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()
    print(f"core: {native.status().reason}; {os.cpu_count()} CPUs")
    print("load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    wall, pooled = timed_plan("--workers", "2")
    cells = pooled["cells"]
    assert isinstance(cells, list)
    verdicts = [f"[{'PASS' if wall < TARGET_POOL_S else 'FAIL'}] {len(cells)}-cell plan, "
                f"process pool of 2: {wall:.1f} s (target < {TARGET_POOL_S:g} s)"]
    print(verdicts[-1])
    if not args.skip_ray:
        one, ray1 = timed_plan("--ray", "--workers", "1")
        two, ray2 = timed_plan("--ray", "--workers", "2")
        assert ray1["cells"] == ray2["cells"] == pooled["cells"], "Ray changed the results"
        speedup = one / two
        verdicts.append(
            f"[{'PASS' if speedup >= TARGET_RAY_SPEEDUP else 'FAIL'}] Ray, 1 worker {one:.1f} s, "
            f"2 workers {two:.1f} s: {speedup:.2f}x (target >= {TARGET_RAY_SPEEDUP}x); "
            f"results identical to the pool's"
        )
        print(verdicts[-1])
        # Context, not the verdict: the part of each figure that does not shrink with workers
        # (Ray's start and stop, the actors' start and trace parse), timed as a one-cell plan.
        fixed, _ = timed_plan("--ray", "--workers", "2", grid=ONE_CELL)
        if two > fixed:
            print(f"  Ray's fixed cost (a one-cell plan on 2 workers): {fixed:.1f} s; the cells "
                  f"alone: 1 worker {one - fixed:.1f} s, 2 workers {two - fixed:.1f} s: "
                  f"{(one - fixed) / (two - fixed):.2f}x")
    print("load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print("\n".join(verdicts))


if __name__ == "__main__":
    main_()
