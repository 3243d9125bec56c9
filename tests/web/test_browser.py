"""The lab in a real browser: Debian's chromium driven by Playwright against a live server.

`make test` installs chromium (apt) and Playwright (pip, dev extra); Playwright never downloads a
browser here, it drives /usr/bin/chromium. Without chromium the test is skipped, unless
KVREUSE_REQUIRE_BROWSER is set (as `make test` does), where a missing browser is a failure.
Screenshots land in artifacts/ (git-ignored).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvreuse.testing.servers import ServerThread
from kvreuse.web.app import create_app
from kvreuse.web.missions import MISSIONS

CHROMIUM = Path(os.environ.get("KVREUSE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
RUN_TIMEOUT_MS = 60_000

ANSWERS: dict[str, list[tuple[str, Any]]] = {
    "mission-1": [("cache_enabled", True)],
    "mission-2": [("timestamp_at", 1496)],
    "mission-3": [("replicas", 3), ("routing", "cache_aware")],
    "mission-4": [("spill_threshold_s", 0.1)],
}
"""Controls a player changes to solve each mission (tests/web/test_missions.py checks the same
answers on the simulator directly)."""


def _require_browser() -> Any:
    required = os.environ.get("KVREUSE_REQUIRE_BROWSER") == "1"
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing: run `make chromium` (apt-get install chromium)"
        if required:
            pytest.fail(message)
        pytest.skip(message)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if required:
            pytest.fail("playwright is not installed: pip install -e '.[dev]'")
        pytest.skip("playwright is not installed")
    return sync_playwright


@pytest.fixture(scope="module")
def lab_url() -> Iterator[str]:
    """A real uvicorn server on a free port of 127.0.0.1, in a thread."""
    with ServerThread(create_app()) as server:
        yield server.url + "/"


def _tiles(page: Any) -> dict[str, str]:
    result: dict[str, str] = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll('.tile')]"
        ".map(t => [t.dataset.tile, t.querySelector('.v').textContent]))"
    )
    return result


def _bars_per_lane(page: Any) -> list[int]:
    """For each replica lane, how many prompt bars have a visible width."""
    counts: list[int] = page.evaluate(
        "() => [...document.querySelectorAll('#bars g.lane')].map(g =>"
        " [...g.querySelectorAll('rect.bar-frame')]"
        ".filter(r => parseFloat(r.getAttribute('width')) > 0).length)"
    )
    return counts


def _lanes_drawn(page: Any) -> bool:
    """Every replica lane has bars exactly when the run routed requests to that replica (a
    router may leave one idle: mission two's exact router does with 1 GiB caches)."""
    routed: list[int] = page.evaluate(
        "() => { const r = window.kvLab.state().result; const n = r.replica_ids.length;"
        " const c = new Array(n).fill(0); for (const i of r.requests.replica) c[i]++;"
        " return c; }"
    )
    bars = _bars_per_lane(page)
    if len(bars) != len(routed):
        return False
    return all((b > 0) == (c > 0) for b, c in zip(bars, routed, strict=True))


def _wait_for_run(page: Any, runs_before: int) -> None:
    page.wait_for_function(
        f"document.body.dataset.state === 'done' && Number(document.body.dataset.runs) > "
        f"{runs_before}",
        timeout=RUN_TIMEOUT_MS,
    )


def _runs(page: Any) -> int:
    return int(page.evaluate("Number(document.body.dataset.runs || 0)"))


def _set_control(page: Any, name: str, value: Any) -> None:
    if name == "timestamp_at":
        page.check("#ts-on")
    selector = f"#ctl-{name}"
    if isinstance(value, bool):
        page.set_checked(selector, value)
    elif page.evaluate(f"document.querySelector('{selector}').tagName") == "SELECT":
        page.select_option(selector, str(value))
    else:
        page.evaluate(
            "([sel, v]) => { const el = document.querySelector(sel); el.value = v;"
            " el.dispatchEvent(new Event('input', {bubbles: true})); }",
            [selector, str(value)],
        )


def test_missions_in_a_real_browser(lab_url: str) -> None:
    """Load the page, run each mission's preset and its answer: tiles change, every replica's
    bars are drawn, the tree appears, the star is earned and survives a reload."""
    sync_playwright = _require_browser()
    ARTIFACTS.mkdir(exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on(
                "console",
                lambda msg: (
                    problems.append(f"console {msg.type}: {msg.text}")
                    if msg.type == "error"
                    else None
                ),
            )
            page.on(
                "request",
                lambda req: (
                    None
                    if req.url.startswith((lab_url, "data:"))
                    else problems.append(f"request outside the lab server: {req.url}")
                ),
            )
            page.add_init_script("window.kvLabOptions = {animationSeconds: 0.6};")
            page.goto(lab_url)
            _wait_for_run(page, 0)
            previous = _tiles(page)
            assert all(v != "–" for v in previous.values()), previous
            assert _bars_per_lane(page) and min(_bars_per_lane(page)) > 0
            page.screenshot(path=str(ARTIFACTS / "lab.png"), full_page=True)

            for mission_id, mission in MISSIONS.items():
                runs = _runs(page)
                page.click(f"button.mission[data-mission='{mission_id}']")
                _wait_for_run(page, runs)
                preset_tiles = _tiles(page)
                assert preset_tiles != previous, f"{mission_id}: tiles did not change"
                lanes = _bars_per_lane(page)
                assert len(lanes) == mission.preset["replicas"], (mission_id, lanes)
                assert _lanes_drawn(page), f"{mission_id}: lanes and routing disagree: {lanes}"
                assert page.locator("#mission-conditions li.unmet").count() > 0

                runs = _runs(page)
                for name, value in ANSWERS[mission_id]:
                    _set_control(page, name, value)
                page.click("#run")
                _wait_for_run(page, runs)
                solved_tiles = _tiles(page)
                assert solved_tiles != preset_tiles, f"{mission_id}: tiles did not change"
                assert page.locator("#mission-conditions li.unmet").count() == 0, mission_id
                star = page.locator(f"button.mission[data-mission='{mission_id}'] .star")
                assert star.text_content() == "★", mission_id
                assert _lanes_drawn(page), (mission_id, _bars_per_lane(page))
                assert page.locator("#tree circle.tree-node").count() > 0, mission_id
                page.screenshot(path=str(ARTIFACTS / f"lab-{mission_id}.png"), full_page=True)
                previous = solved_tiles

            stars = page.evaluate("JSON.parse(localStorage.getItem('kvreuse-lab-stars'))")
            assert stars == dict.fromkeys(MISSIONS, True)
            page.reload()
            _wait_for_run(page, 0)
            assert page.locator("button.mission .star", has_text="★").count() == len(MISSIONS)
        finally:
            browser.close()
    assert not problems, problems


def test_a_bad_control_shows_the_servers_error(lab_url: str) -> None:
    """A value the server refuses is shown next to the controls, naming the field."""
    sync_playwright = _require_browser()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.add_init_script("window.kvLabOptions = {animationSeconds: 0.3};")
            page.goto(lab_url + "?duration_s=5")
            _wait_for_run(page, 0)
            page.fill("#ctl-seed", "-4")
            page.click("#run")
            page.wait_for_function("document.body.dataset.state === 'error'", timeout=20_000)
            assert "seed" in (page.text_content("#error") or "")
            assert page.locator("#ctl-seed.invalid").count() == 1
        finally:
            browser.close()


def test_a_link_opens_that_run_with_its_mission(lab_url: str) -> None:
    """A lab_url_for_run link fills the controls from the query and shows the mission."""
    from urllib.parse import urlsplit

    from kvreuse.web.links import lab_url_for_run

    link = lab_url_for_run("mission-3", "cache_aware", 3, seed=4, duration_s=5)
    assert link is not None
    sync_playwright = _require_browser()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.add_init_script("window.kvLabOptions = {animationSeconds: 0.3};")
            page.goto(lab_url + "?" + urlsplit(link).query)
            _wait_for_run(page, 0)
            assert page.input_value("#ctl-routing") == "cache_aware"
            assert page.input_value("#ctl-seed") == "4"
            assert len(_bars_per_lane(page)) == 3
            assert page.is_visible("#mission-panel")
            assert "Half the fleet" in (page.text_content("#mission-title") or "")
        finally:
            browser.close()


def test_the_page_opens_on_the_figures_simulate_prints(
    lab_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cache slider starts on the shared default pool (10,892 tokens, not a slider step
    near it), and the first run's tiles are `simulate --scenario belgavi` round robin on 6."""
    import json

    from kvreuse import defaults
    from kvreuse.cli.main import main

    assert main(["simulate", "--scenario", "belgavi", "--policy", "round_robin", "--replicas",
                 "6", "--no-baseline", "--json", "-"]) == 0
    run = next(r for r in json.loads(capsys.readouterr().out)["runs"] if r["variant"] == "")
    sync_playwright = _require_browser()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.add_init_script("window.kvLabOptions = {animationSeconds: 0.3};")
            page.goto(lab_url)
            _wait_for_run(page, 0)
            assert page.input_value("#ctl-cache_tokens") == str(defaults.CACHE_TOKENS)
            assert f"{defaults.CACHE_TOKENS:,} tokens" in (
                page.text_content("#out-cache_tokens") or ""
            )
            tiles = page.evaluate("window.kvLab.state().result.tiles")
            for name in ("token_hit_rate", "prefill_gpu_s_per_1k", "ttft_p95_s"):
                assert tiles[name] == round(run[name], 4), name
            assert _tiles(page)["token_hit_rate"].startswith(f"{run['token_hit_rate']:.1%}"[:4])
        finally:
            browser.close()


def test_the_report_in_a_browser_links_to_the_same_runs(lab_url: str, tmp_path: Path) -> None:
    """mission-4's report renders every plot in chromium; its lab links point at this lab (not
    a hard-coded port), keep the cache size, and open the run the report's row shows."""
    from kvreuse.cli.main import main

    report = tmp_path / "mission-4.html"
    assert main(["simulate", "--scenario", "mission-4", "--scale", "0.5", "--cache-tokens",
                 "12000", "--report", str(report), "--lab-url", lab_url]) == 0
    sync_playwright = _require_browser()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.goto(report.as_uri())
            widths = page.evaluate("[...document.images].map(i => i.naturalWidth)")
            assert len(widths) >= 5 and min(widths) > 0, widths
            page.screenshot(path=str(ARTIFACTS / "report-mission-4.png"), full_page=True)
            links = page.evaluate("[...document.querySelectorAll('td a')].map(a => a.href)")
            assert len(links) == 8  # seven spill thresholds and the no-cache baseline
            assert all(link.startswith(lab_url) and "cache_tokens=12000" in link
                       for link in links), links
            row = page.evaluate(
                "[...document.querySelectorAll('tr')].find(r => r.textContent"
                ".includes('spill_threshold_s=0.1]')).children[2].textContent"
            )
            link = next(link for link in links if "spill_threshold_s=0.1&" in link)
            page.add_init_script("window.kvLabOptions = {animationSeconds: 0.3};")
            page.goto(link)
            _wait_for_run(page, 0)
            assert page.input_value("#ctl-cache_tokens") == "12000"
            tiles = page.evaluate("window.kvLab.state().result.tiles")
            assert f"{tiles['token_hit_rate']:.1%}" == row
            page.screenshot(path=str(ARTIFACTS / "lab-from-report.png"), full_page=True)
        finally:
            browser.close()
