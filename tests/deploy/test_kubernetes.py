"""deploy/kubernetes: the example manifests agree with each other and with kvreuse's own
command line (no cluster here: what can drift is checked, the rest is Kubernetes')."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from kvreuse.cli.main import build_parser
from kvreuse.cli.route import build_config

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def documents(name: str) -> dict[str, dict[str, Any]]:
    """The file's objects by kind."""
    return {doc["kind"]: doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text())}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def flag(args: list[str], name: str) -> str:
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(name + "=")]
    assert len(values) == 1, f"{name} given {len(values)} times"
    return values[0]


def test_the_gateway_arguments_are_a_valid_kvreuse_route_command_line() -> None:
    """The container's arguments parse and build a gateway configuration: one discovery, the
    drain settings, metrics on their own port."""
    gateway = container(documents("gateway.yaml")["Deployment"])
    assert gateway["command"] == ["kvreuse"]
    config = build_config(build_parser().parse_args(gateway["args"]))
    assert config.upstreams == () and len(config.discovery) == 1
    assert config.metrics_port == 9464 and config.drain_delay_s == 5.0


def test_the_gateway_discovers_the_vllm_services_pods_on_their_ports() -> None:
    """The discovered name is the vLLM Service's, which is headless; its port and the KV
    events port are the ones the vLLM pods serve and bind."""
    vllm = documents("vllm.yaml")
    service, engine = vllm["Service"], container(vllm["Deployment"])
    gateway = container(documents("gateway.yaml")["Deployment"])
    discovery = build_config(build_parser().parse_args(gateway["args"])).discovery[0]
    meta = service["metadata"]
    assert discovery.dns == f"{meta['name']}.{meta['namespace']}.svc.cluster.local"
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses", False)
    ports = {port["name"]: port["port"] for port in service["spec"]["ports"]}
    assert discovery.port == ports["http"] == int(flag(engine["args"], "--port"))
    events = json.loads(flag(engine["args"], "--kv-events-config"))
    assert events["endpoint"] == f"tcp://*:{discovery.events_port}"
    assert discovery.events_port == ports["kv-events"] and events["topic"] == discovery.topic
    assert engine["readinessProbe"]["httpGet"]["port"] == discovery.port


def test_the_gateway_pod_stops_inside_its_grace_period_and_probes_its_own_port() -> None:
    """terminationGracePeriodSeconds covers the drain and the grace for requests in flight;
    readiness reads /ready and liveness /health on the serving port; the Service routes to
    that port and the metrics port."""
    objects = documents("gateway.yaml")
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    gateway = container(objects["Deployment"])
    config = build_config(build_parser().parse_args(gateway["args"]))
    assert pod["terminationGracePeriodSeconds"] >= config.drain_delay_s + config.shutdown_grace_s
    port = int(flag(gateway["args"][1:], "--port"))
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}
    served = {p["port"] for p in objects["Service"]["spec"]["ports"]}
    assert served == {port, config.metrics_port}
    assert objects["Deployment"]["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
