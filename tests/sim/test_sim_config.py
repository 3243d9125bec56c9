"""Configurations and results are plain frozen dataclasses: they pickle, copy and replace."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random

import pytest

from kvreuse.errors import ConfigError
from kvreuse.routing import build_policy
from kvreuse.sim import FleetConfig, FleetSimulator, ReplicaConfig
from kvreuse.sim.config import MAX_REPLICAS
from kvreuse.sim.scenarios import get_scenario


def test_configs_survive_pickle_and_deepcopy() -> None:
    """A fleet configuration comes back equal from pickle and deepcopy."""
    config = FleetConfig(4, ReplicaConfig(pool_tokens=5000, cache_kind="block"), 0.1, 0.05)
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.deepcopy(config) == config


def test_replace_validates_like_the_constructor() -> None:
    """dataclasses.replace makes a new config and rejects what the constructor rejects."""
    config = FleetConfig(3, ReplicaConfig())
    assert dataclasses.replace(config, replicas=6).replicas == 6
    with pytest.raises(ConfigError, match="scheduling"):
        dataclasses.replace(config.replica, scheduling="sjf")


def test_an_absurd_fleet_size_is_refused_before_anything_is_built() -> None:
    """A fleet past MAX_REPLICAS is a ConfigError naming the bound, not hours of allocation."""
    FleetConfig(MAX_REPLICAS)
    with pytest.raises(ConfigError, match="at most 100,000, got 100,000,000"):
        FleetConfig(100_000_000)


def test_a_run_survives_pickle() -> None:
    """A finished run, records included, comes back equal from pickle."""
    scenario = get_scenario("belgavi")
    policy = build_policy("round_robin", rng=random.Random(0))
    run = FleetSimulator(scenario.fleet(3, ""), policy).run(scenario.requests(0, "", 0.05))
    assert run.records and pickle.loads(pickle.dumps(run)) == run
