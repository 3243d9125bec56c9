"""Real processes on 127.0.0.1 for the load benchmarks and multi-process tests.

`kvreuse engine` replicas, `kvreuse route` gateways, peer routers (sglang-router, vllm-router,
smg from the ``.venv-peers`` environment that ``make peers`` builds) and ``redis-server``, each
started on a free port with its output in a log file, waited for until it answers, and stopped
(SIGTERM, then SIGKILL) when the :class:`Fleet` closes. Nothing binds anything but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from kvreuse.routing import build_policy
from kvreuse.testing.servers import free_listen_port, free_port

REPO = Path(__file__).resolve().parents[3]
PEERS_VENV = Path(os.environ.get("KVREUSE_PEERS_VENV", REPO / ".venv-peers"))


@dataclass
class Process:
    """A started child process, its log and (for servers) its base URL."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""
    port: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory from /proc (0 when the process is gone)."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return 0
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, wait, then SIGKILL: always ends this very process (never by name)."""
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL: a crash, as the fault-injection runs want it."""
        if self.alive():
            self.popen.kill()
            self.popen.wait(5.0)


def wait_http(proc: Process, path: str = "/health", timeout_s: float = 60.0) -> None:
    """Poll ``proc.url + path`` until it answers 200, or raise with the log's tail. 60 s: a
    process that starts in 2 s alone once took over 30 s in a full ``make test`` run on the
    2-core CI machine; waiting longer costs only a failing run's time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            # 2 s a probe: an upstream that answers /health 1 s late (misbehaving
            # slow-health --delay 1) raced a 1 s timeout and failed a CI run.
            if httpx.get(proc.url + path, timeout=2.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} did not answer {path} in {timeout_s} s:\n{proc.log_tail()}")


def wait_tcp(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def vllm_python(root: Path) -> str | None:
    """The vLLM interpreter: ``$KVREUSE_VLLM_PYTHON``, else ``root/.venv-vllm`` (``make
    vllm-env``); None when that file does not exist."""
    explicit = os.environ.get("KVREUSE_VLLM_PYTHON")
    if explicit:
        return explicit if Path(explicit).exists() else None
    default = root / ".venv-vllm" / "bin" / "python"
    return str(default) if default.exists() else None

@dataclass(frozen=True, slots=True)
class EngineSpec:
    """``kvreuse engine`` settings shared by every replica of a fleet."""

    model: str = "sim"
    cache_tokens: int = 32_768
    block_size: int = 16
    prefill_tokens_per_s: float = 10_000.0
    overhead_ms: float = 15.0
    tpot_ms: float = 5.0
    events: bool = True
    events_bound_by_gateway: bool = False  # the engine connects; one gateway binds the port
    tokenizer: str | None = None
    extra_args: tuple[str, ...] = ()


class Fleet:
    """Starts processes and stops every one of them on :meth:`close` (or ``with``)."""

    def __init__(self, workdir: Path | None = None, *, python: str = sys.executable) -> None:
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="kvreuse-fleet-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.processes: list[Process] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()

    def spawn(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
              url: str = "", port: int = 0, cpus: Collection[int] | None = None) -> Process:
        """Start ``argv``, its output to ``name``.log; with ``cpus``, on those CPUs only (set
        as soon as it exists: a program that starts children seconds later, as vLLM does,
        passes them the same)."""
        log_path = self.workdir / f"{name}.log"
        log = log_path.open("wb")
        popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                 cwd=self.workdir)
        log.close()
        if cpus is not None:
            os.sched_setaffinity(popen.pid, cpus)
        proc = Process(name, popen, log_path, url, port)
        self.processes.append(proc)
        return proc

    def forget(self, proc: Process) -> None:
        """Stop one process and drop it from the fleet."""
        proc.stop()
        with contextlib.suppress(ValueError):
            self.processes.remove(proc)

    # ------------------------------------------------------------------ engines

    def engine_argv(self, spec: EngineSpec, port: int, events_port: int) -> list[str]:
        argv = [self.python, "-m", "kvreuse.cli.main", "engine", "--host", "127.0.0.1",
                "--port", str(port), "--model", spec.model,
                "--cache-tokens", str(spec.cache_tokens), "--block-size", str(spec.block_size),
                "--prefill-tokens-per-s", str(spec.prefill_tokens_per_s),
                "--overhead-ms", str(spec.overhead_ms), "--tpot-ms", str(spec.tpot_ms)]
        if spec.events:
            # tcp://*:P makes the engine bind (vLLM's rule), so any number of gateways connect;
            # tcp://127.0.0.1:P makes it connect to the one gateway that binds P.
            host = "127.0.0.1" if spec.events_bound_by_gateway else "*"
            argv += ["--kv-events", f"tcp://{host}:{events_port}", "--kv-events-topic",
                     "kv-events"]
        if spec.tokenizer:
            argv += ["--tokenizer", spec.tokenizer]
        return argv + list(spec.extra_args)

    def start_engine(self, name: str, spec: EngineSpec, *, port: int | None = None,
                     events_port: int | None = None, wait: bool = True) -> Process:
        port = port or free_port()
        events_port = events_port or free_listen_port()
        proc = self.spawn(name, self.engine_argv(spec, port, events_port),
                          url=f"http://127.0.0.1:{port}", port=port)
        if spec.events:
            proc.extra["events"] = f"tcp://127.0.0.1:{events_port}"
            proc.extra["events_bind"] = "true" if spec.events_bound_by_gateway else "false"
        if wait:
            wait_http(proc)
        return proc

    def start_engines(self, count: int, spec: EngineSpec) -> list[Process]:
        engines = [self.start_engine(f"engine{i}", spec, wait=False) for i in range(count)]
        for engine in engines:
            wait_http(engine)
        return engines

    # ------------------------------------------------------------------ gateways

    def gateway_argv(self, engines: Sequence[Process], port: int, *, policy: str,
                     events: bool, extra_args: Sequence[str] = ()) -> list[str]:
        # --drain-delay 0: stop() gives a process 5 s after SIGTERM, and a fleet stopping
        # has no load balancer to drain from (a later --drain-delay in extra_args wins).
        argv = [self.python, "-m", "kvreuse.cli.main", "route", "--host", "127.0.0.1",
                "--port", str(port), "--policy", policy, "--drain-delay", "0"]
        for engine in engines:
            flag = f"{engine.url},name={engine.name}"
            if events and "events" in engine.extra:
                bind = engine.extra.get("events_bind", "false")
                flag += f",events={engine.extra['events']},bind={bind},topic=kv-events"
            argv += ["--upstream", flag]
        return argv + list(extra_args)

    def start_gateway(self, name: str, engines: Sequence[Process], *, policy: str,
                      events: bool | None = None, extra_args: Sequence[str] = (),
                      shared_index: str | None = None, wait: bool = True) -> Process:
        """``kvreuse route`` in front of ``engines``; KV events when the policy uses them (or
        ``events``); with ``shared_index`` (a redis:// URL) the approximate index is shared."""
        port = free_port()
        if events is None:
            events = build_policy(policy).uses_kv_events
        argv = self.gateway_argv(engines, port, policy=policy, events=events,
                                 extra_args=extra_args)
        if shared_index:
            argv += ["--shared-index", shared_index]
        proc = self.spawn(name, argv, url=f"http://127.0.0.1:{port}", port=port)
        if wait:
            wait_http(proc)
        return proc

    def start_misbehaving(self, name: str, mode: str, *extra: str) -> Process:
        """A :mod:`kvreuse.testing.misbehaving` upstream in ``mode`` (``extra``: its other
        flags, e.g. ``--bytes``)."""
        port = free_port()
        proc = self.spawn(name, [self.python, "-m", "kvreuse.testing.misbehaving", "--port",
                                 str(port), "--mode", mode, *extra],
                          url=f"http://127.0.0.1:{port}", port=port)
        wait_http(proc)
        return proc

    # ------------------------------------------------------------------ peers and redis

    def peer_argv(self, kind: str, engines: Sequence[Process], port: int,
                  block_size: int = 16, model: str = "sim") -> list[str]:
        """Launch lines of the peer routers, every listener bound to 127.0.0.1."""
        py = str(PEERS_VENV / "bin" / "python")
        urls = [e.url for e in engines]
        metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        common = ["--host", "127.0.0.1", "--port", str(port), *metrics]
        if kind == "sglang-router":
            return [py, "-m", "sglang_router.launch_router", "--policy", "cache_aware",
                    "--worker-urls", *urls, *common, "--log-level", "warn"]
        if kind == "smg":
            return [str(PEERS_VENV / "bin" / "smg"), "launch", "--policy", "cache_aware",
                    "--worker-urls", *urls, *common, "--log-level", "warn"]
        if kind == "vllm-router":
            return [str(PEERS_VENV / "bin" / "vllm-router"), "--policy", "cache_aware",
                    "--worker-urls", *urls, *common, "--log-level", "warning"]
        if kind == "vllm-router-kv":
            sources: list[str] = []
            for engine in engines:
                sources += ["--kv-event-source", f"{engine.url}={engine.extra['events']}"]
            return [str(PEERS_VENV / "bin" / "vllm-router"), "--policy", "kv_aware",
                    "--worker-urls", *urls, *sources, "--kv-event-block-size",
                    str(block_size), "--kv-event-model", model, *common,
                    "--log-level", "warning"]
        raise ValueError(f"unknown peer router {kind!r}")

    def start_peer(self, kind: str, engines: Sequence[Process], *,
                   env: dict[str, str] | None = None, block_size: int = 16,
                   model: str = "sim") -> Process:
        port = free_port()
        proc = self.spawn(kind, self.peer_argv(kind, engines, port, block_size, model), env=env,
                          url=f"http://127.0.0.1:{port}", port=port)
        wait_http(proc, "/health", timeout_s=60.0)
        return proc

    def start_vllm(self, name: str, python: str, model_dir: str, *,
                   block_size: int = 32, max_model_len: int = 2048,
                   cpus: Collection[int] | None = None) -> Process:
        """A real vLLM replica (the CPU recipe of tests/vllm): prefix caching, prompt-token
        details, KV events on a publisher it binds (so gateways and peers connect), the
        development endpoints (``/reset_prefix_cache``). With ``cpus`` it runs on those CPUs
        only, its engine-core child too (pinned before it is started): replicas pinned apart
        do not take each other's cores, as replicas on separate accelerators would not.
        Returns at once; wait with :func:`wait_http` on ``/v1/models`` (40-100 s on two
        cores)."""
        import json

        port, events_port = free_port(), free_listen_port()
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://*:{events_port}", "topic": "kv-events"}
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--max-model-len", str(max_model_len),
                "--block-size", str(block_size), "--enable-prefix-caching",
                "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events),
                "--enforce-eager", "-O0", "--max-num-seqs", "16"]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": "1"}
        proc = self.spawn(name, argv, env=env, url=f"http://127.0.0.1:{port}", port=port,
                          cpus=cpus)
        proc.extra["events"] = f"tcp://127.0.0.1:{events_port}"
        proc.extra["events_bind"] = "false"
        return proc

    def start_redis(self) -> Process:
        """``redis-server`` on a free 127.0.0.1 port, no persistence."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make redis` "
                               "(apt-get install -y redis-server)")
        port = free_port()
        proc = self.spawn("redis", [binary, "--bind", "127.0.0.1", "--port", str(port),
                                    "--save", "", "--appendonly", "no",
                                    "--protected-mode", "yes"],
                          url=f"redis://127.0.0.1:{port}/0", port=port)
        wait_tcp(port)
        return proc


def peers_available() -> bool:
    """Whether ``make peers`` has built the peer routers' environment."""
    return (PEERS_VENV / "bin" / "vllm-router").exists()
