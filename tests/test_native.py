"""The compiled core (kvreuse.native): when it is used, and that it runs exactly like the source."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvreuse import native
from kvreuse.native import NATIVE_MODULES, decide, digest, source_file


def fake_tree(root: Path, modules: tuple[str, ...], *, built: bool = True) -> None:
    """Sources (and, when ``built``, extensions plus a matching manifest) under ``root``."""
    for module in modules:
        source = source_file(module, root)
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(f"NAME = {module!r}\n")
        if built:
            source.with_name(source.stem + native_suffix()).write_bytes(b"")
    if built:
        native.shared_library(root).write_bytes(b"")
        record = {
            "python": sys.implementation.cache_tag,
            "sources": {m: digest(source_file(m, root)) for m in modules},
        }
        (root / "kvreuse" / native.MANIFEST.name).write_text(json.dumps(record))


def native_suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


MODULES = ("kvreuse.alpha", "kvreuse.sub.beta")


def test_a_fresh_build_is_used(tmp_path: Path) -> None:
    """Extensions for every module and a manifest matching every source: compiled."""
    fake_tree(tmp_path, MODULES)
    assert decide(tmp_path, MODULES, {}).compiled


def test_an_unbuilt_tree_runs_pure(tmp_path: Path) -> None:
    """No extension at all: pure Python, and the reason says how to build."""
    fake_tree(tmp_path, MODULES, built=False)
    status = decide(tmp_path, MODULES, {})
    assert not status.compiled and "make native" in status.reason


def test_an_edited_source_turns_the_whole_core_off(tmp_path: Path) -> None:
    """A source changed since the build: pure Python, naming the module."""
    fake_tree(tmp_path, MODULES)
    source_file("kvreuse.sub.beta", tmp_path).write_text("NAME = 'edited'\n")
    status = decide(tmp_path, MODULES, {})
    assert not status.compiled and "kvreuse.sub.beta changed" in status.reason


def test_the_environment_can_force_pure(tmp_path: Path) -> None:
    """KVREUSE_PURE=1 wins over a good build; KVREUSE_PURE=0 does not."""
    fake_tree(tmp_path, MODULES)
    assert not decide(tmp_path, MODULES, {native.PURE_ENV: "1"}).compiled
    assert decide(tmp_path, MODULES, {native.PURE_ENV: "0"}).compiled


def test_a_manifest_of_another_python_is_refused(tmp_path: Path) -> None:
    """A build for another interpreter is not used."""
    fake_tree(tmp_path, MODULES)
    manifest = tmp_path / "kvreuse" / native.MANIFEST.name
    record = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**record, "python": "cpython-39"}))
    assert "another Python" in decide(tmp_path, MODULES, {}).reason


def test_a_partial_build_is_refused(tmp_path: Path) -> None:
    """One extension missing (an interrupted build): pure Python, naming it."""
    fake_tree(tmp_path, MODULES)
    alpha = source_file("kvreuse.alpha", tmp_path)
    alpha.with_name(alpha.stem + native_suffix()).unlink()
    status = decide(tmp_path, MODULES, {})
    assert not status.compiled and "kvreuse.alpha" in status.reason


def test_a_build_without_its_shared_library_is_refused(tmp_path: Path) -> None:
    """The modules' extensions only forward to the shared library: without it, pure Python."""
    fake_tree(tmp_path, MODULES)
    native.shared_library(tmp_path).unlink()
    status = decide(tmp_path, MODULES, {})
    assert not status.compiled and "__mypyc" in status.reason


def test_the_source_hook_loads_py_files_only_for_its_modules(tmp_path: Path) -> None:
    """SourceFirst answers for its modules with the .py file and leaves others alone."""
    fake_tree(tmp_path, MODULES)
    hook = native.SourceFirst({m: source_file(m, tmp_path) for m in MODULES})
    spec = hook.find_spec("kvreuse.alpha", None)
    assert spec is not None and spec.origin == str(source_file("kvreuse.alpha", tmp_path))
    assert hook.find_spec("kvreuse.gamma", None) is None


def test_every_compiled_module_has_a_source() -> None:
    """The list names real modules of the package."""
    assert all(source_file(m).exists() for m in NATIVE_MODULES)


# --------------------------------------------------------------------- compiled vs source

RUN_DIGEST = textwrap.dedent(
    """
    import dataclasses, hashlib, json, random
    from kvreuse import native
    from kvreuse.routing import build_policy
    from kvreuse.sim import FleetSimulator
    from kvreuse.sim.scenarios import get_scenario

    scenario = get_scenario("belgavi")
    requests = scenario.requests(0, "", 0.3)
    out = {"compiled": native.status().compiled, "runs": {}}
    for name in ("round_robin", "cache_aware", "cache_aware_sglang", "exact", "cost"):
        for kind in ("radix", "block"):
            fleet = scenario.fleet(3, "")
            replica = dataclasses.replace(fleet.replica, cache_kind=kind)
            fleet = dataclasses.replace(fleet, replica=replica, kv_event_lag_s=0.05)
            policy = build_policy(name, rng=random.Random(0),
                                  **scenario.policy_options.get(name, {}))
            run = FleetSimulator(fleet, policy).run(requests)
            h = hashlib.sha256()
            for record in run.records:
                h.update(repr(dataclasses.astuple(record)).encode())
            h.update(repr((run.evicted_tokens, run.prefill_busy_s, run.events_processed,
                           run.end_time_s)).encode())
            out["runs"][f"{name}/{kind}"] = h.hexdigest()
    for view in ("measured", "known"):
        fleet = dataclasses.replace(scenario.fleet(3, ""), prefill_speeds=(0.25, 1.0, 1.0),
                                    speed_view=view, load_view="router", first_byte_lag_s=0.002)
        run = FleetSimulator(fleet, build_policy("relative_spill")).run(requests)
        h = hashlib.sha256(repr([dataclasses.astuple(r) for r in run.records]).encode())
        out["runs"][f"relative_spill/speeds {view}"] = h.hexdigest()
    fleet = dataclasses.replace(scenario.fleet(3, ""),
                                speed_changes=((5.0, 0, 0.25), (12.0, 0, 1.0)))
    run = FleetSimulator(fleet, build_policy("relative_spill")).run(requests)
    h = hashlib.sha256(repr(([dataclasses.astuple(r) for r in run.records],
                             sorted(run.prefill_s_by_request.items()))).encode())
    out["runs"]["relative_spill/speed changes"] = h.hexdigest()
    print(json.dumps(out))
    """
)


def run_digests(pure: bool) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    if pure:
        env[native.PURE_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-c", RUN_DIGEST], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.skipif(not native.decide().compiled, reason=native.decide().reason)
def test_compiled_and_pure_cores_give_identical_runs() -> None:
    """Seeded belgavi runs (five policies, radix and block caches, lagged KV events; the
    default on a fleet of mixed speeds, measured and known, and on one whose speeds change
    mid-run) are bit-identical with the compiled core and with the source."""
    compiled, pure = run_digests(pure=False), run_digests(pure=True)
    assert compiled["compiled"] is True and pure["compiled"] is False
    assert compiled["runs"] == pure["runs"]
    assert len(set(compiled["runs"].values())) == 13  # type: ignore[attr-defined]


def test_forcing_pure_loads_every_core_module_from_source() -> None:
    """With KVREUSE_PURE=1 each compiled module comes from its .py file."""
    script = (
        "import importlib, json; from kvreuse.native import NATIVE_MODULES; "
        "print(json.dumps([importlib.import_module(m).__file__ for m in NATIVE_MODULES]))"
    )
    env = {**os.environ, native.PURE_ENV: "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    files = json.loads(done.stdout)
    assert files == [str(source_file(m)) for m in NATIVE_MODULES]


def test_the_process_loads_the_core_it_chose() -> None:
    """The modules loaded are the compiled ones exactly when activate() chose compiled."""
    from kvreuse.index import radix

    assert radix.__file__ is not None
    assert radix.__file__.endswith(".so") == native.status().compiled
