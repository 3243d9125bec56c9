"""Start real vLLM replicas (CPU build, tiny random Llama) for the tests in this directory.

Everything the recipe in DEVELOPERS.md says, as code: a separate interpreter
(``KVREUSE_VLLM_PYTHON``), ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB), prefix caching, KV events over
ZeroMQ to an address the *gateway* binds (a ``tcp://127.0.0.1:P`` endpoint makes vLLM connect),
a replay endpoint vLLM binds, prompt-token details in usage, and ``VLLM_SERVER_DEV_MODE=1`` for
``POST /reset_prefix_cache``. ``--enforce-eager -O0`` skip torch.compile: start-up falls from
~95 s to ~40 s and a 4-layer model does not need it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvreuse.testing.servers import free_listen_port

BLOCK_SIZE = 32  # the CPU attention backend wants multiples of 32 (its default is 128)
MODEL_NAME = "tiny-llama"
ALIAS_NAME = "tiny-llama-b"
"""A second served name of replica 1 only (vLLM's --served-model-name a b: one cache), so the
pair serves partly overlapping model sets."""
START_TIMEOUT_S = float(os.environ.get("KVREUSE_VLLM_START_TIMEOUT", "600"))


@dataclass
class Replica:
    """One vLLM server process and its endpoints."""

    name: str
    process: subprocess.Popen[bytes]
    url: str
    events: str
    replay: str
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the replica's whole process group (API server, engine core, workers)."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def launch(name: str, python: str, model_dir: Path, log_dir: Path,
           served: tuple[str, ...] = (MODEL_NAME,)) -> Replica:
    """Start one replica serving the model under the ``served`` names; returns at once (see
    :func:`wait_ready`)."""
    # Every port comes from below Linux's ephemeral range (free_listen_port): the gateway binds
    # the events endpoint after vLLM starts connecting to it, and vLLM binds its own HTTP and
    # replay ports some 30 s after they were picked, while the other replica's ZeroMQ
    # reconnects take a fresh ephemeral source port every 100 ms. An ephemeral pick was once
    # taken in between ("Address already in use" on the replay port, a CI run lost).
    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(free_listen_port())
    port, events_port, replay_port = sorted(ports)
    events = f"tcp://127.0.0.1:{events_port}"
    replay = f"tcp://127.0.0.1:{replay_port}"
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                 "replay_endpoint": replay, "topic": "kv-events"}
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", *served,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(kv_events),
        "--enforce-eager", "-O0", "--max-num-seqs", "16",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "OMP_NUM_THREADS": "1"}
    log_path = log_dir / f"{name}.log"
    log = log_path.open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    log.close()
    return Replica(name, process, f"http://127.0.0.1:{port}", events, replay, log_path)


def wait_ready(replicas: list[Replica], timeout_s: float = START_TIMEOUT_S) -> None:
    """Block until every replica serves /v1/models; raise with its log if one dies."""
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if replica.process.poll() is not None:
                raise RuntimeError(f"vLLM replica {replica.name} exited "
                                   f"({replica.process.returncode}):\n{replica.log_tail()}")
            try:
                if httpx.get(replica.url + "/v1/models", timeout=2).status_code == 200:
                    pending.remove(replica)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"vLLM replica {pending[0].name} not ready after {timeout_s}s:\n"
                               f"{pending[0].log_tail()}")
        time.sleep(1.0)


def build_model(python: str, out: Path) -> Path:
    """Build (or find up to date) the tiny model with the vLLM interpreter."""
    script = Path(__file__).with_name("build_tiny_model.py")
    subprocess.run([python, str(script), str(out)], check=True, capture_output=True)
    return out
