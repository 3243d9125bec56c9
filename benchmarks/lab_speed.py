"""How long the lab takes to render sixty simulated seconds of its default scenario.

Issue 7's target: "Sixty simulated seconds of the default scenario render in under a second"
(belgavi's support chat, 30 req/s, round robin on six replicas, 1 GB caches; the lab also
simulates the scenario's 20 s of warm-up before the sixty measured seconds). Measured in the same
run, each the median of ``--repeat`` runs with a new seed each time (so no result cache helps):

* ``simulator alone``: the peer: kvreuse.sim generating the same traffic and simulating it on
  the same fleet and policy, nothing else;
* ``lab run``: :meth:`kvreuse.web.adapter.SimLab.run`: traffic generation, simulation through the
  observing policy wrapper, mid-run tree snapshot, per-second timeline;
* ``lab run + JSON``: the above plus building and serialising the response body;
* ``HTTP POST /api/run``: the whole server path through starlette's TestClient;
* ``browser`` (with ``--browser``, needs /usr/bin/chromium and playwright): from clicking Run to
  the first frame drawn in headless chromium (fetch, parse, building the bars), as the page
  reports it in ``data-ready-ms``.

Run: ``.venv/bin/python benchmarks/lab_speed.py [--repeat N] [--browser]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from starlette.testclient import TestClient

from kvreuse.routing import build_policy
from kvreuse.sim import FleetSimulator
from kvreuse.sim.scenarios import BELGAVI, get_scenario
from kvreuse.testing.servers import ServerThread
from kvreuse.web.adapter import SimLab
from kvreuse.web.app import create_app
from kvreuse.web.controls import LabControls
from kvreuse.web.result import result_to_json

CHROMIUM = Path("/usr/bin/chromium")


def _median_s(action: Callable[[int], object], repeat: int) -> float:
    times = []
    for attempt in range(repeat):
        started = time.perf_counter()
        action(1000 + attempt)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def simulator_alone(seed: int) -> float:
    """Seconds kvreuse.sim takes for the lab's default run: traffic generation + simulation."""
    controls = LabControls()
    scenario = get_scenario(controls.scenario)
    fleet = scenario.fleet(controls.replicas, "")
    fleet = replace(fleet, replica=replace(fleet.replica, pool_tokens=controls.cache_tokens))
    policy = build_policy(controls.routing, rng=random.Random(seed))
    started = time.perf_counter()
    requests = replace(BELGAVI, duration_s=controls.duration_s).generate(seed)
    FleetSimulator(fleet, policy).run(requests)
    return time.perf_counter() - started


def browser_ready_ms(repeat: int) -> list[float]:
    from playwright.sync_api import sync_playwright

    server = ServerThread(create_app()).start()
    ready = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM),
                args=[
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                ],
            )
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.add_init_script("window.kvLabOptions = {animationSeconds: 0.2};")
            page.goto(server.url + "/")
            page.wait_for_function("document.body.dataset.state === 'done'")
            for attempt in range(repeat):
                runs = page.evaluate("Number(document.body.dataset.runs)")
                page.fill("#ctl-seed", str(2000 + attempt))
                page.click("#run")
                page.wait_for_function(
                    f"document.body.dataset.state === 'done' && "
                    f"Number(document.body.dataset.runs) > {runs}"
                )
                ready.append(float(page.evaluate("document.body.dataset.readyMs")))
            browser.close()
    finally:
        server.stop()
    return ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--browser", action="store_true")
    args = parser.parse_args()
    lab = SimLab()
    client = TestClient(create_app())
    # Warm imports and caches of code paths (not of results: every timed run has its own seed).
    lab.run(LabControls(seed=1))

    sim_s = statistics.median(simulator_alone(1000 + n) for n in range(args.repeat))
    lab_s = _median_s(lambda seed: lab.run(LabControls(seed=seed)), args.repeat)
    sizes: list[int] = []

    def lab_json(seed: int) -> None:
        sizes.append(len(json.dumps(result_to_json(lab.run(LabControls(seed=seed))))))

    json_s = _median_s(lab_json, args.repeat)

    def http(seed: int) -> None:
        response = client.post("/api/run", json={"seed": seed + 500})
        assert response.status_code == 200, response.text

    http_s = _median_s(http, args.repeat)
    result = lab.run(LabControls(seed=7))
    requests = len(result.requests.arrival_s)
    print("lab speed: belgavi default view, 60 measured simulated seconds (+20 s warm-up)")
    print(f"  measured requests per run           {requests:>8,}")
    print(f"  simulator alone (peer)              {sim_s * 1000:>8.1f} ms")
    print(
        f"  lab run                             {lab_s * 1000:>8.1f} ms"
        f"   ({lab_s / sim_s:.2f}x the simulator alone)"
    )
    print(
        f"  lab run + JSON body                 {json_s * 1000:>8.1f} ms"
        f"   (body {statistics.median(sizes) / 1024:.0f} KiB)"
    )
    print(
        f"  HTTP POST /api/run                  {http_s * 1000:>8.1f} ms"
        f"   target < 1000 ms: {'met' if http_s < 1.0 else 'NOT met'}"
    )
    if args.browser:
        ready = browser_ready_ms(args.repeat)
        median = statistics.median(ready)
        print(
            f"  browser: click Run -> first frame   {median:>8.1f} ms"
            f"   target < 1000 ms: {'met' if median < 1000 else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
