"""Links into the lab for a given run, so other outputs (``kvreuse simulate --report``) can say
"open this run in the lab".

The page reads its query string on load, fills the controls from it and runs it; the server
validates the same keys with :func:`kvreuse.web.controls.parse_query`, so a link either opens
exactly that run or shows which parameter the lab cannot take.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from kvreuse.defaults import LAB_HOST, LAB_PORT, lab_base_url
from kvreuse.web.controls import LabControls

DEFAULT_HOST = LAB_HOST
DEFAULT_PORT = LAB_PORT


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def lab_query(controls: LabControls | Mapping[str, Any]) -> str:
    """The query string (without ``?``) for a run: only values that differ from the lab's
    defaults, in a stable order. ``controls`` may be a :class:`LabControls` or a mapping of its
    field names (e.g. ``{"scenario": "belgavi", "replicas": 3, "routing": "cache_aware"}``);
    ``None`` values are left out. O(fields)."""
    given = controls.as_dict() if isinstance(controls, LabControls) else dict(controls)
    defaults = LabControls().as_dict()
    pairs = [
        (key, _text(value))
        for key, value in given.items()
        if value is not None and (key not in defaults or value != defaults[key])
    ]
    return urlencode(pairs)


def lab_url(
    controls: LabControls | Mapping[str, Any],
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    base_url: str | None = None,
) -> str:
    """``http://host:port/?...`` (or ``base_url?...``) opening ``controls`` in a lab started
    with ``kvreuse lab`` (default address: ``kvreuse lab`` with no flags)."""
    query = lab_query(controls)
    base = base_url if base_url is not None else lab_base_url(host, port)
    base = base.split("?", 1)[0]
    if not base.endswith("/"):
        base += "/"
    return base + (f"?{query}" if query else "")


VARIANT_CONTROLS: dict[str, dict[str, Any]] = {
    "": {},
    "no_cache": {"cache_enabled": False},
    "timestamp": {"timestamp_at": 200},
}
"""How the simulator's scenario variants read as lab controls (``timestamp`` is mission two's
"time to the second at token 200 of the system prompt")."""

NEVER_SPILL_S = 60.0
"""The lab's largest spill threshold; it stands for the simulator's ``inf`` (never spill)."""


def lab_url_for_run(
    scenario: str,
    policy: str,
    replicas: int,
    *,
    seed: int = 0,
    variant: str = "",
    options: Mapping[str, Any] | None = None,
    cache_tokens: int | None = None,
    duration_s: float | None = None,
    scale: float = 1.0,
    scheduling: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    base_url: str | None = None,
) -> str | None:
    """The lab link for one run of ``kvreuse simulate`` (a scenario's ``RunSpec`` and seed), or
    ``None`` when the lab cannot show that very run: a scenario that is not one of the lab's
    chat scenarios (six-turn, contract-library, traces), an unknown variant, or a policy option
    the lab has no control for (``overload``, ``load_metric``...: the lab would run the
    policy's default instead and show other figures).

    ``spill_threshold_s`` carries over (``inf`` as :data:`NEVER_SPILL_S`). ``cache_tokens``
    (the run's KV pool per replica) defaults to the lab's, which is the simulator's belgavi
    pool; ``duration_s`` to the scenario's measured window times ``scale`` (``simulate
    --scale``). A mission scenario opens with that mission's goal shown. O(1).
    """
    from kvreuse.web.adapter import LAB_TRAFFIC  # the simulator's names, read lazily
    from kvreuse.web.missions import MISSIONS

    if scenario not in LAB_TRAFFIC or variant not in VARIANT_CONTROLS:
        return None
    if any(key != "spill_threshold_s" for key in (options or {})):
        return None
    controls: dict[str, Any] = {
        "scenario": scenario,
        "routing": policy,
        "replicas": replicas,
        "seed": seed,
        **VARIANT_CONTROLS[variant],
    }
    spill = (options or {}).get("spill_threshold_s")
    if spill is not None:
        controls["spill_threshold_s"] = min(float(spill), NEVER_SPILL_S)
    if cache_tokens is not None:
        controls["cache_tokens"] = cache_tokens
    if duration_s is None and scale != 1.0:
        duration_s = LAB_TRAFFIC[scenario].duration_s * scale
    if duration_s is not None:
        controls["duration_s"] = duration_s
    if scheduling is not None:
        controls["scheduling"] = scheduling
    if scenario in MISSIONS:
        controls["mission"] = scenario  # the page shows the mission's goal for this run
    return lab_url(controls, host=host, port=port, base_url=base_url)
