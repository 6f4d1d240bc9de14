"""The process kubelet's own pieces, without a cluster: the atomic volume layout that live reloads rely on,
and the container environment a pod spec asks for."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from operator_process import refused_requests
from pod_env import PodSpecError, container_argv, container_env, quantity
from pod_volumes import atomic_write

POD = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
    "spec": {
        "nodeName": "node-a",
        "containers": [
            {"name": "c", "resources": {"limits": {"memory": "1Gi"}, "requests": {"cpu": "500m"}}}
        ],
    },
}


def test_atomic_volume_swaps_one_symlink(tmp_path):
    root = tmp_path / "vol"
    assert atomic_write(root, {"runtime.yaml": b"a: 1\n", "sub/x": b"x"})
    first = os.readlink(root / "..data")
    assert os.readlink(root / "runtime.yaml") == "..data/runtime.yaml"
    assert (root / "sub" / "x").read_bytes() == b"x"
    assert not atomic_write(root, {"runtime.yaml": b"a: 1\n", "sub/x": b"x"})  # unchanged: no new dir
    assert atomic_write(root, {"runtime.yaml": b"a: 2\n"})
    second = os.readlink(root / "..data")
    assert second != first and not (root / first).exists()  # the old generation is gone
    assert (root / "runtime.yaml").read_bytes() == b"a: 2\n" and not (root / "sub").exists()
    assert sorted(p.name for p in root.iterdir()) == sorted([second, "..data", "runtime.yaml"])


def test_container_env_resolves_value_from_and_expands():
    objects = {"configmaps/ns/cm": {"kind": "ConfigMap", "data": {"k": "from-cm"}}}

    async def get(kind, key):
        return objects.get(f"{kind}/{key}")

    container = {
        "name": "c",
        "command": ["tokenfleet", "serve", "--name=$(POD)", "$$(POD)"],
        "env": [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {
                "name": "MEM",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},  # unset: node's
            {"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "GREETING", "value": "hi $(POD) on $(NODE_UNKNOWN)"},
        ],
    }
    env = asyncio.run(container_env(POD, container, get, "10.213.0.1", 6443, "10.213.0.5", "10.213.0.1",
                                    {"cpu": "8", "memory": "32Gi"}, "/image/bin"))  # fmt: skip
    assert env["POD"] == "p" and env["IP"] == "10.213.0.5" and env["K"] == "from-cm"
    assert env["MEM"] == "1024" and env["CPU"] == "8"
    assert env["GREETING"] == "hi p on $(NODE_UNKNOWN)"
    assert env["KUBERNETES_SERVICE_HOST"] == "10.213.0.1" and env["PATH"].split(":")[0] == "/image/bin"
    assert container_argv(container, env) == ["tokenfleet", "serve", "--name=p", "$(POD)"]
    missing = {
        **container,
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "no", "key": "k"}}}],
    }
    with pytest.raises(PodSpecError, match="couldn't find key k"):
        asyncio.run(container_env(POD, missing, get, "h", 1, "", "", {}, "/image/bin"))


def test_quantities():
    assert quantity("500m") == quantity("0.5") and quantity("4Gi") == 4 * 2**30 and quantity("1k") == 1000
    with pytest.raises(PodSpecError):
        quantity("lots")


def test_an_operator_403_counts_when_rbac_refused_it_and_the_api_server_was_not_restarting():
    restart = time.mktime(time.strptime("2026-12-05 15:07:30", "%Y-%m-%d %H:%M:%S"))
    rbac = 'x is forbidden: User "system:serviceaccount:ns:op" cannot watch resource "x"'
    log = (
        f"2026-12-05 15:07:32,984 ERROR kopf: GET /apis/x -> APIForbiddenError('{rbac}')\n"
        "Reason: Forbidden\n"  # the same record's traceback
        f"2026-12-05 15:09:00,001 ERROR kopf: GET /apis/y -> APIForbiddenError('{rbac}')\n"
        "2026-12-05 15:09:01,000 ERROR kopf: create failed\n"
        "Reason: Forbidden\n"
        'HTTP response body: {"message": "p is forbidden: create not allowed while custom resource '
        'definition is terminating"}\n'
    )
    (refused,) = refused_requests(log, [(restart, restart + 4)])
    assert refused.startswith("2026-12-05 15:09:00,001")
    assert len(refused_requests(log, [])) == 2
