"""Where ``kvreuse plan`` runs its cells: here, on a local process pool, or on Ray, and what
it does when a worker dies under it.

A plan of many cells runs for minutes to hours, and its largest cells are the ones most likely
to be killed: by the kernel's OOM killer, by a Ray node lost from a cluster, by an operator. A
dead worker used to end the whole plan with a ``BrokenProcessPool`` or ``ActorDiedError``
traceback (measured: a 144-cell plan on two workers, one worker killed 4 s in). Now
:func:`run_cells` runs a dead worker's cells again and goes on:

* The cells a worker was running when it died are *suspects*. On the pool one death breaks the
  whole pool, so every cell in flight is one; on Ray only the dead actor's cell is. Suspects
  then run one at a time, alone, so a second death names its cell for certain, and an innocent
  cell that happened to run beside the culprit is done at its first lone run.
* A cell whose worker died :data:`MAX_DEATHS` times (once beside others at most, then alone) is
  reported as :class:`~kvreuse.errors.WorkerDiedError` naming it; the cells finished before
  are in the plan's cache, so the same command resumes without them.

Ctrl-C stops a plan at once instead of after every queued cell: pool workers ignore SIGINT
(one ``KeyboardInterrupt`` in the parent, not one traceback per worker), at most ``workers``
cells are ever queued, and those running are terminated (measured before: 13.8 s after Ctrl-C
on a small plan, running cells whose results were then thrown away).
"""

from __future__ import annotations

import logging
import signal
import socket
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvreuse.errors import ConfigError, WorkerDiedError
from kvreuse.sim.config import ReplicaConfig
from kvreuse.sim.plan import Cell, CellResult, run_cell
from kvreuse.sim.requests import SimRequest
from kvreuse.trace import parse_trace_lines, trace_requests

MAX_DEATHS = 3
"""A cell is given up on when its worker has died this often: once beside other cells at most,
then twice alone. Memory is the usual killer, and a cell that ran a worker out of it alone
twice will do so again."""


class Traffic:
    """The trace parsed once per process: its requests and the units they are counted in."""

    def __init__(self, data: bytes, source: str, block: int, granularity: str) -> None:
        records = parse_trace_lines(data.splitlines(), source, block)
        self.requests: list[SimRequest]
        self.requests, self.units = trace_requests(records, block, granularity, source)


WorkerInit = tuple[bytes, str, int, str, ReplicaConfig, int]
"""What every worker is started with: the trace's bytes, its name, block size, granularity,
the replicas' configuration and the policies' seed."""

_WORKER: dict[str, Any] = {}


def _worker_init(data: bytes, source: str, block: int, granularity: str,
                 replica: ReplicaConfig, seed: int) -> None:
    _WORKER["traffic"] = Traffic(data, source, block, granularity)
    _WORKER["replica"] = replica
    _WORKER["seed"] = seed


def _pool_worker_init(*init: Any) -> None:
    # Ctrl-C reaches the whole process group; the parent alone answers it (and stops us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_init(*init)


def _worker_run(cell: Cell) -> dict[str, Any]:
    traffic: Traffic = _WORKER["traffic"]
    result = run_cell(cell, traffic.requests, traffic.units, _WORKER["replica"], _WORKER["seed"])
    return result.as_dict()


class WorkerDied(Exception):
    """Raised by :meth:`Workers.result`: the worker running that cell died; ``str`` says how."""


class Workers(Protocol):
    """Processes that run cells, some of which may die (:func:`run_cells` drives them)."""

    def submit(self, cell: Cell) -> Any:
        """Start ``cell`` on an idle worker (the caller never has more cells running than
        workers) and return a handle to wait on; a dead worker is replaced first."""
        ...

    def wait(self, handles: Sequence[Any]) -> list[Any]:
        """Block until at least one of ``handles`` has finished; return those that have."""
        ...

    def result(self, handle: Any) -> dict[str, Any]:
        """The finished cell's result (``CellResult.as_dict``); :class:`WorkerDied` when its
        worker died. An error the cell raised itself is raised as it is."""
        ...

    def close(self, finished: bool) -> None:
        """Release the workers: waiting for them when ``finished``, else (an interrupt, an
        error) stopping any still running."""
        ...


def run_cells(cells: Iterable[Cell], workers: Workers, parallel: int,
              warn: Callable[[str], None]) -> Iterator[CellResult]:
    """Every cell's result, in the order they finish, on ``parallel`` workers at a time, the
    cells of dead workers run again alone (module docstring); ``warn`` is told of each death.
    Raises :class:`~kvreuse.errors.WorkerDiedError` for a cell whose worker died
    :data:`MAX_DEATHS` times. O(cells) beside the runs."""
    queue: deque[Cell] = deque(cells)
    suspects: deque[Cell] = deque()
    deaths: Counter[Cell] = Counter()
    running: dict[Any, Cell] = {}
    finished = False
    try:
        while queue or suspects or running:
            limit = 1 if suspects else parallel
            while len(running) < limit and (suspects or queue):
                cell = suspects.popleft() if suspects else queue.popleft()
                running[workers.submit(cell)] = cell
            for handle in workers.wait(list(running)):
                cell = running.pop(handle)
                try:
                    payload = workers.result(handle)
                except WorkerDied as death:
                    deaths[cell] += 1
                    if deaths[cell] >= MAX_DEATHS:
                        raise WorkerDiedError(
                            f"cell {cell.key()}: its worker died {deaths[cell]} times, the last "
                            f"with no other cell running ({death}); memory is the usual cause "
                            "(the kernel's OOM killer): leave this cell's fleet out, or give "
                            "each worker more memory (fewer --workers)") from None
                    warn(f"a worker died with cell {cell.key()} running ({death}); it runs again, "
                         "alone")
                    suspects.append(cell)
                    continue
                yield CellResult.from_dict(payload)
        finished = True
    finally:
        workers.close(finished)


class PoolWorkers:
    """:class:`Workers` on a local :class:`ProcessPoolExecutor`, started again after a death
    (one dead process breaks the whole pool: every cell in flight is then reported dead)."""

    def __init__(self, init: WorkerInit, workers: int) -> None:
        self._init = init
        self._size = workers
        self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=self._size, initializer=_pool_worker_init,
                                   initargs=self._init)

    def submit(self, cell: Cell) -> Future[dict[str, Any]]:
        try:
            return self._pool.submit(_worker_run, cell)
        except BrokenProcessPool:  # a death seen by the pool before we read it
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._start()
            return self._pool.submit(_worker_run, cell)

    def wait(self, handles: Sequence[Any]) -> list[Any]:
        return list(wait(handles, return_when=FIRST_COMPLETED).done)

    def result(self, handle: Any) -> dict[str, Any]:
        future: Future[dict[str, Any]] = handle
        try:
            return future.result()
        except BrokenProcessPool:
            raise WorkerDied("a worker process ended abruptly: killed, or out of memory") from None

    def close(self, finished: bool) -> None:
        if finished:
            self._pool.shutdown(wait=True)
            return
        # Python 3.14 has ProcessPoolExecutor.terminate_workers; 3.11 reaches them so. The
        # pool is then waited for (its manager thread sees the deaths and ends at once): left
        # running, that thread could close its wake-up pipe while the interpreter's exit
        # writes to it, a traceback after the "interrupted" line (2 runs in 14).
        for process in list((getattr(self._pool, "_processes", None) or {}).values()):
            process.terminate()
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayWorkers:
    """:class:`Workers` on Ray actors, each holding the parsed trace; a dead actor (its node
    lost, its process killed) is replaced by a new one, which Ray places where it can."""

    def __init__(self, init: WorkerInit, workers: int, address: str) -> None:
        try:
            import ray
            from ray.exceptions import RayActorError
        except ImportError:
            raise ConfigError("--ray needs Ray: pip install 'kvreuse[ray]'") from None
        self._ray = ray
        self._actor_error = RayActorError
        if address:
            _check_reachable(address)
            try:
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
            except (ConnectionError, ValueError) as exc:  # Ray's words for a bad or dead one
                raise ConfigError(f"--ray {address}: {exc}") from None
        else:
            # The local instance's workers inherit this process's environment and working
            # directory, so a PYTHONPATH source tree is theirs too; passing it again as a
            # runtime_env cost every actor's start 1.5 s here (Ray 2.60) for nothing.
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR)
        self._class = ray.remote(num_cpus=1)(_RayWorker)
        self._data = ray.put(init[0])
        self._init = init
        self._idle = [self._new_actor() for _ in range(workers)]
        self._actor_of: dict[Any, Any] = {}

    def _new_actor(self) -> Any:
        return self._class.remote(self._data, *self._init[1:])

    def submit(self, cell: Cell) -> Any:
        actor = self._idle.pop()
        handle = actor.run.remote(cell)
        self._actor_of[handle] = actor
        return handle

    def wait(self, handles: Sequence[Any]) -> list[Any]:
        ready, _ = self._ray.wait(list(handles), num_returns=1)
        return list(ready)

    def result(self, handle: Any) -> dict[str, Any]:
        actor = self._actor_of.pop(handle)
        try:
            payload: dict[str, Any] = self._ray.get(handle)
        except self._actor_error as exc:
            self._idle.append(self._new_actor())
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise WorkerDied(f"Ray: {first_line or type(exc).__name__}") from None
        self._idle.append(actor)
        return payload

    def close(self, finished: bool) -> None:
        # Actors belong to this driver's job: shutting down ends them, here or on a cluster.
        self._ray.shutdown()


RAY_CONNECT_TIMEOUT_S = 10.0


def _check_reachable(address: str) -> None:
    """Refuse a ``--ray HOST:PORT`` (or ``ray://HOST:PORT``) where nothing accepts a
    connection: ``ray.init`` retries such an address without end (measured: still retrying,
    a warning every 30 s, after 3 minutes). Other forms (``auto``, ``local``) are Ray's to
    resolve. A cluster that accepts the connection and then hangs is not caught here."""
    parsed = urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:  # a port that is not a number: Ray's to judge
        return
    if not host or port is None:
        return
    try:
        with socket.create_connection((host, port), RAY_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"--ray {address}: nothing answers at {host}:{port} ({reason}); "
                          "start the cluster (ray start --head) or give its address, or "
                          "leave the address out for a local instance") from None


class _RayWorker:
    """A Ray actor holding the parsed trace; cells are sent to it one at a time."""

    def __init__(self, data: bytes, source: str, block: int, granularity: str,
                 replica: ReplicaConfig, seed: int) -> None:
        _worker_init(data, source, block, granularity, replica, seed)

    def run(self, cell: Cell) -> dict[str, Any]:
        return _worker_run(cell)
