"""The Kubernetes manifests in deploy/kubernetes/ (docs/deployment.md): each is valid YAML of named objects, the
data-parallel ones start nodes that this launcher accepts and that agree with each other, and the
LeaderWorkerSet's workers join their leader headless."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

import launch

MANIFESTS = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"


def documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc is not None]


def container(doc: dict, template: str = "template") -> dict:
    return doc["spec"][template]["spec"]["containers"][0]


def by_kind(name: str, kind: str) -> dict:
    return next(doc for doc in documents(name) if doc["kind"] == kind)


@pytest.mark.parametrize("name", sorted(p.name for p in MANIFESTS.glob("*.yaml")))
def test_every_manifest_is_yaml_of_named_kubernetes_objects(name):
    docs = documents(name)
    assert docs
    for doc in docs:
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]


def frontend_argv() -> list[str]:
    c = container(by_kind("dp-frontend.yaml", "Deployment"))
    assert c["command"] == ["clearserve", "serve"]
    return [arg.replace("$(POD_IP)", "10.0.0.1") for arg in c["args"]]


def headless_argv(ordinal: int) -> list[str]:
    c = container(by_kind("dp-headless.yaml", "StatefulSet"))
    assert c["command"] == ["/bin/sh", "-c"]
    script = c["args"][0].replace("$$(( ${HOSTNAME##*-} + 1 ))", str(ordinal + 1))  # what the shell computes
    words = shlex.split(script)
    assert words[:3] == ["exec", "clearserve", "serve"]
    return words[3:]


def test_the_data_parallel_nodes_are_started_with_flags_the_launcher_accepts_and_agree():
    frontend = launch.parse_args(frontend_argv())
    statefulset = by_kind("dp-headless.yaml", "StatefulSet")
    headless = [launch.parse_args(headless_argv(k)) for k in range(statefulset["spec"]["replicas"])]
    assert not frontend.headless and all(node.headless for node in headless)
    assert {node.data_parallel_size for node in headless} == {frontend.data_parallel_size}
    # Every replica is served once: the frontend node's from 0, pod k's from k + 1.
    served = list(range(frontend.data_parallel_size_local))
    for node in headless:
        start = node.data_parallel_start_rank
        served += range(start, start + node.data_parallel_size_local)
    assert served == list(range(frontend.data_parallel_size))
    # Headless nodes reach the frontend node through its RPC Service, on the port it listens on.
    rpc = next(doc for doc in documents("dp-frontend.yaml") if doc["metadata"]["name"] == "clearserve-dp-rpc")
    assert {node.data_parallel_address for node in headless} == {rpc["metadata"]["name"]}
    assert {node.data_parallel_rpc_port for node in headless} == {frontend.data_parallel_rpc_port}
    assert rpc["spec"]["ports"][0]["port"] == frontend.data_parallel_rpc_port


def test_every_node_reads_the_cluster_secret_from_the_kubernetes_secret():
    secret = by_kind("cluster-secret.yaml", "Secret")["metadata"]["name"]
    containers = [
        container(by_kind("dp-frontend.yaml", "Deployment")),
        container(by_kind("dp-headless.yaml", "StatefulSet")),
    ]
    for c in containers:
        env = {e["name"]: e for e in c["env"]}
        assert env["CLEARSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == secret


def test_the_rpc_port_is_open_to_headless_pods_only():
    policy = by_kind("dp-frontend.yaml", "NetworkPolicy")
    rpc_rules = [rule for rule in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 29550} in rule["ports"]]
    assert [rule["from"] for rule in rpc_rules] == [
        [{"podSelector": {"matchLabels": {"app": "clearserve", "role": "dp-headless"}}}]
    ]


def test_the_leaderworkerset_workers_join_their_leader_headless():
    lws = by_kind("tp-leaderworkerset.yaml", "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    leader = template["leaderTemplate"]["spec"]["containers"][0]["args"]
    worker = " ".join(template["workerTemplate"]["spec"]["containers"][0]["args"])
    assert "--nnodes=2" in leader and "--node-rank=0" in leader and "--headless" not in leader
    size = template["size"]
    assert f"--nnodes={size}" in worker
    for flag in ("--node-rank=$(LWS_WORKER_INDEX)", "--master-addr=$(LWS_LEADER_ADDRESS)", "--headless"):
        assert flag in worker
