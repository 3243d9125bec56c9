"""kvreuse plan's workers: a worker that dies costs its cell a rerun, not the plan; a cell that
keeps killing its worker is named; Ctrl-C stops at once and keeps the finished cells."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvreuse.cli.plan_workers as plan_workers
from kvreuse.cli.main import main
from kvreuse.cli.plan_workers import MAX_DEATHS, WorkerDied, run_cells
from kvreuse.errors import WorkerDiedError
from kvreuse.sim.plan import Cell, CellResult

from .interrupt import interrupt_kvreuse
from .plan_traces import GRID, plan, write_trace

SRC = str(Path(__file__).resolve().parents[2] / "src")
VICTIM = "cache_aware x2 cache=200000 spill_threshold_s=1.0"


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trace whose cells take a few tenths of a second each, so a plan lasts seconds."""
    return write_trace(tmp_path_factory, 3000)


KILLING: dict[str, Any] = {}
"""What :func:`killing_worker_run` kills: set before the pool forks, so its workers see it."""


def killing_worker_run(cell: Cell) -> dict[str, Any]:
    """``_worker_run``, but a worker SIGKILLs itself the first ``KILLING["times"]`` times it
    is given the cell keyed ``KILLING["victim"]`` (counted in files under ``KILLING["marks"]``,
    shared by every worker). Module-level: the pool sends its workers functions by name."""
    if cell.key() == KILLING["victim"]:
        marks: Path = KILLING["marks"]
        tries = len(list(marks.glob("death-*")))
        if tries < KILLING["times"]:
            (marks / f"death-{tries}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
    result: dict[str, Any] = KILLING["real"](cell)
    return result


def kill_on(monkeypatch: pytest.MonkeyPatch, victim: str, times: int, marks: Path) -> None:
    """Make pool workers die on ``victim`` (:func:`killing_worker_run`) for this test."""
    monkeypatch.setitem(KILLING, "victim", victim)
    monkeypatch.setitem(KILLING, "times", times)
    monkeypatch.setitem(KILLING, "marks", marks)
    monkeypatch.setitem(KILLING, "real", plan_workers._worker_run)
    monkeypatch.setattr(plan_workers, "_worker_run", killing_worker_run)


@pytest.mark.skipif(sys.platform != "linux", reason="the pool's workers must be forked")
def test_a_worker_killed_mid_plan_costs_a_rerun_not_the_plan(
        trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A pool worker SIGKILLed under a cell: the plan finishes with the serial run's cells and
    says which cell ran again."""
    serial = plan(trace, tmp_path / "s.json", "--serial", "--no-cache")
    kill_on(monkeypatch, VICTIM, 1, tmp_path)
    capsys.readouterr()
    pooled = plan(trace, tmp_path / "p.json", "--workers", "2", "--no-cache")
    assert len(list(tmp_path.glob("death-*"))) == 1
    assert pooled["cells"] == serial["cells"] and pooled["winner"] == serial["winner"]
    out = " ".join(capsys.readouterr().out.split())
    assert f"a worker died with cell {VICTIM} running" in out, out


@pytest.mark.skipif(sys.platform != "linux", reason="the pool's workers must be forked")
def test_a_cell_that_kills_every_worker_is_named_and_the_finished_cells_resume(
        trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A cell whose worker dies every time fails the plan after MAX_DEATHS deaths with an
    error naming it; the cells finished before are cached and the next run starts from them."""
    cache = tmp_path / "cache"
    kill_on(monkeypatch, VICTIM, 1000, tmp_path)
    args = ["plan", "--trace", str(trace), *GRID, "--workers", "2", "--cache-dir", str(cache)]
    assert main(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert len(list(tmp_path.glob("death-*"))) == MAX_DEATHS
    assert f"error: cell {VICTIM}: its worker died {MAX_DEATHS} times" in err, err
    finished = len(list(cache.glob("*.json")))
    assert f"{finished} of 12 cells finished; they are in {cache}" in err, err
    assert "Traceback" not in err
    monkeypatch.undo()
    assert main([*args, "--json", str(tmp_path / "again.json")]) == 0
    assert f"{finished} from the cache" in " ".join(capsys.readouterr().out.split())


class Scripted:
    """Workers whose deaths are scripted: a cell in ``kills`` dies whenever it runs, and a
    death takes every cell running beside it, as one dead process breaks a process pool."""

    def __init__(self, kills: set[str]) -> None:
        self.kills = kills
        self.running: list[tuple[int, Cell]] = []
        self.ran: list[list[str]] = []  # the cells in flight at each wait
        self.closed: bool | None = None
        self._next = 0

    def submit(self, cell: Cell) -> int:
        self._next += 1
        self.running.append((self._next, cell))
        return self._next

    def wait(self, handles: Sequence[Any]) -> list[Any]:
        self.ran.append(sorted(cell.key() for _, cell in self.running))
        return list(handles)

    def result(self, handle: Any) -> dict[str, Any]:
        cells = dict(self.running)
        cell = cells[handle]
        broken = any(c.key() in self.kills for c in cells.values())
        self.running = [(h, c) for h, c in self.running if h != handle]
        if broken:
            raise WorkerDied("scripted")
        return CellResult(cell, 10, 0.5, 1.0, 0.1, 0.2, 0.3, 0.01).as_dict()

    def close(self, finished: bool) -> None:
        self.closed = finished


def cells(count: int) -> list[Cell]:
    return [Cell("round_robin", replicas, 1000) for replicas in range(1, count + 1)]


def test_the_cells_beside_a_death_finish_alone_and_only_the_killer_is_named() -> None:
    """Two cells die together; each then runs alone: the innocent one finishes, and the
    killer is named after MAX_DEATHS deaths, with the workers stopped, not waited for."""
    workers = Scripted({"round_robin x2 cache=1000"})
    warnings: list[str] = []
    done: list[str] = []
    with pytest.raises(WorkerDiedError, match="cell round_robin x2 cache=1000: its worker died 3"):
        for result in run_cells(cells(3), workers, 2, warnings.append):
            done.append(result.cell.key())
    assert done == ["round_robin x1 cache=1000"]
    assert workers.ran[0] == ["round_robin x1 cache=1000", "round_robin x2 cache=1000"]
    assert all(len(batch) == 1 for batch in workers.ran[1:]), workers.ran
    # Both cells of the first death, then the killer's first death alone (its second alone
    # is the error).
    assert len(warnings) == 3 and all("runs again, alone" in w for w in warnings), warnings
    assert workers.closed is False


def test_without_deaths_every_cell_runs_once_and_the_workers_are_waited_for() -> None:
    """No death: every cell's result comes back once, ``parallel`` at a time at most."""
    workers = Scripted(set())
    results = list(run_cells(cells(5), workers, 2, lambda message: None))
    assert sorted(r.cell.replicas for r in results) == [1, 2, 3, 4, 5]
    assert max(len(batch) for batch in workers.ran) == 2
    assert workers.closed is True


def test_ctrl_c_stops_the_plan_at_once_and_keeps_the_finished_cells(
        long_trace: Path, tmp_path: Path) -> None:
    """SIGINT to the plan's process group (a terminal's Ctrl-C) mid-plan: exit 130 within
    seconds, one line saying how many cells are kept, no traceback, no worker left."""
    cache = tmp_path / "cache"

    def first_cell_kept(child: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 120
        while not list(cache.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)

    stopped = interrupt_kvreuse(
        ["plan", "--trace", str(long_trace), "--policy", "round_robin,cache_aware,exact",
         "--replicas", "1,2,3,4", "--cache-tokens", "60000,200000", "--slo", "ttft_p95=0.6",
         "--workers", "2", "--cache-dir", str(cache)], first_cell_kept, timeout_s=30)
    out = stopped.output
    assert stopped.code == 130, out
    assert stopped.took_s < 10, f"stopped {stopped.took_s:.1f} s after Ctrl-C"
    assert "Traceback" not in out, out
    kept = len(list(cache.glob("*.json")))
    said = re.search(r"interrupted: (\d+) of (\d+) cells finished; they are in", out)
    assert said is not None and int(said[1]) == kept < int(said[2]), out
    with pytest.raises(ProcessLookupError):
        os.killpg(stopped.pid, 0)  # no worker of the group is left running


def ray_workers_of_this_user() -> list[int]:
    """The pids of Ray actor processes running ``_RayWorker`` (their title is set by Ray)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::_RayWorker"):
                found.append(int(entry.name))
    return found


@pytest.fixture
def actor_killer() -> Iterator[list[int]]:
    """A thread that SIGKILLs the first Ray ``_RayWorker`` process it sees; the killed pids."""
    killed: list[int] = []
    stop = threading.Event()

    def hunt() -> None:
        while not stop.is_set() and not killed:
            for pid in ray_workers_of_this_user():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                break
            time.sleep(0.01)

    thread = threading.Thread(target=hunt, daemon=True)
    thread.start()
    yield killed
    stop.set()
    thread.join()


@pytest.mark.ray
@pytest.mark.skipif(sys.platform != "linux", reason="finds Ray's actors in /proc")
def test_ray_replaces_an_actor_killed_mid_plan(
        long_trace: Path, tmp_path: Path, actor_killer: list[int],
        capsys: pytest.CaptureFixture[str]) -> None:
    """A Ray actor SIGKILLed as the plan starts: a new actor runs its cell, and the plan gives
    the serial run's cells."""
    small = ["--policy", "round_robin,cache_aware", "--replicas", "2", "--cache-tokens",
             "200000", "--knob", "0.2", "--slo", "ttft_p95=0.6", "--no-cache"]
    base = ["plan", "--trace", str(long_trace), *small]
    assert main([*base, "--ray", "--workers", "2", "--json", str(tmp_path / "r.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert actor_killer, "no Ray actor was seen to kill"
    assert "a worker died with cell" in out and "(Ray: " in out, out
    assert main([*base, "--serial", "--json", str(tmp_path / "s.json")]) == 0
    on_ray = json.loads((tmp_path / "r.json").read_text())
    serial = json.loads((tmp_path / "s.json").read_text())
    assert on_ray["cells"] == serial["cells"]


@pytest.mark.ray
def test_a_ray_address_where_nothing_listens_is_refused_at_once(
        trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--ray HOST:PORT with nothing there: a one-line error within seconds (Ray itself would
    retry without end)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]  # bound, not listening: connections are refused
        started = time.monotonic()
        code = main(["plan", "--trace", str(trace), *GRID, "--ray", f"127.0.0.1:{port}",
                     "--no-cache"])
    assert code == 1 and time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert f"--ray 127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}" in err, err
