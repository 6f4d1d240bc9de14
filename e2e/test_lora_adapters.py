"""LoRA adapters on a real cluster, as a user swaps one: `spec.adapters` edited on a claim the pods already
mount is applied live — the pod unloads the adapter that went and loads the new one, the router routes the
new name and refuses the old one — with no restart and no rollout.

1. two random PEFT adapters (rank 4 on q/v, the built-in model's shapes) on one PersistentVolumeClaim; a
   ModelDeployment serving the first, behind a RoutingPolicy, keys on (both require a user key from a
   Secret; the router reaches the pods and the operator their /load with the internal key): through the
   router the adapter's name answers (under its own name) and so does the base model's; without a key the
   router and the pod answer 401;
2. spec.adapters edited to the second adapter, same claim, plus a third from the Hub (`hf://`, a private
   repository pinned at a commit: the token from a Secret through `lora.hfTokenSecret`, a mirror through
   `lora.hfEndpoint`; the Hub is a stand-in on the session's bridge, fake_hub.py, holding the first
   adapter's files): through the router both new names answer within seconds — the Hub's adapter with the
   same tokens the first adapter gave from the claim, downloaded once, with the token; the old name is a 404
   `model_not_found` in OpenAI's error shape, from the router and from the pod itself (it unloaded it), and
   the pod's list has the new adapters with the base model as their parent; the Hub's adapter has
   `minCopies: 1`, so the operator pins it on the pod (with the internal key) and the status says so;
3. the same pod (uid), no container restart, and the same pod template (config hash, generation, one
   ReplicaSet): nothing rolled.

The harness's kubelets give a claim a directory of their own (pod_volumes.py: `<kubelet workdir>/pvc/
NAMESPACE/CLAIM`), so the adapters are written into each node's; the PersistentVolume behind the claim only
lets the scheduler bind it (its hostPath is never read).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from fake_hub import FakeHub, FakeRepo, serve_hub
from pod_keys import auth_headers, internal_key
from workload import TEST_KV_CACHE_GIB, get_json

MODEL_READY_S = 240
WAITS = {
    "the claim Bound": 30,
    "1 runtime pod Ready": MODEL_READY_S,
    "router Ready": MODEL_READY_S,
    "qv-a through the router": 60,
    "qv-b through the router": 60,
    "qv-c through the router": 60,
    "status.adapters": 30,  # the operator asks the pods every 5 s
}
SETUP_S = 60
HASH = "serving.tokenfleet.dev/config-hash"
CLAIM = "adapters"
BASE = "smol"  # the base model's served name
RUNTIME = "app.kubernetes.io/instance=lora,app.kubernetes.io/component=runtime"
ROUTER = "app.kubernetes.io/instance=front,app.kubernetes.io/component=router"
# Adapter name -> (folder on the claim, seed of its random weights).
ADAPTERS = {"qv-a": ("a", 1), "qv-b": ("b", 2)}
# The Hub's adapter: the first adapter's files as a private repository of their own, pinned at a commit.
HUB_REPO = "tinyorg/qv-c"
HUB_COMMIT = "fade" + "0" * 36
HUB_SOURCE = f"hf://{HUB_REPO}@{HUB_COMMIT}"
HUB_TOKEN = "hf_e2eAdapterTokenNeverLogged"
HUB_SECRET = "hf-adapters"
# Keys on, as a cluster admin deploys: the pods and the router require a user key (the router reaches the
# pods, and the operator their /load, with the deployment's internal key).
USER_KEY = "sk-e2e-lora-user"
USER = {"Authorization": f"Bearer {USER_KEY}"}
KEYS_SECRET = "api-keys"
RANK = 4
WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = {
    "peft_type": "LORA",
    "r": RANK,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "bias": "none",
}


def _write_adapter(folder: Path, seed: int) -> None:
    """A PEFT LoRA folder (what `save_pretrained` writes) with random non-zero A and B for the built-in
    model's q/v projections: its shapes come from the GGUF's metadata (no weights are read)."""
    import torch
    from safetensors.torch import save_file
    from tokenfleet.runtime.model.gguf_file import GGUFFile
    from tokenfleet.runtime.model.gguf_loader import gguf_arch
    from tokenfleet.runtime.model.lora_adapter import projection_shapes
    from tokenfleet.runtime.model.source import builtin_model_path

    gguf = GGUFFile(builtin_model_path("smollm2-135m-instruct"))
    arch = gguf_arch(gguf.metadata, gguf.tensors)
    shapes = projection_shapes(arch)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for proj in ADAPTER_CONFIG["target_modules"]:
            fan_in, fan_out = shapes[proj]
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.05
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.05
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(ADAPTER_CONFIG))
    save_file(tensors, str(folder / WEIGHTS))


def _claim(namespace: str) -> str:
    """The claim and a PersistentVolume bound to it in advance (the scheduler places a pod only once its
    claims are Bound); the harness's kubelets serve the claim from their own directory, not the hostPath."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-{CLAIM}"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": f"/nonexistent/{namespace}/{CLAIM}"},
            "claimRef": {"namespace": namespace, "name": CLAIM},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": pv["metadata"]["name"],
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return yaml.safe_dump_all([pv, pvc])


def _manifests(adapters: list[str], hub_url: str) -> str:
    cache = {
        "apiVersion": "serving.tokenfleet.dev/v1alpha1",
        "kind": "CachePolicy",
        "metadata": {"name": "small"},
        "spec": {"cpuKVCacheGiB": TEST_KV_CACHE_GIB},
    }
    routing = {
        "apiVersion": "serving.tokenfleet.dev/v1alpha1",
        "kind": "RoutingPolicy",
        "metadata": {"name": "front"},
        "spec": {"strategy": "least-load", "router": {"replicas": 1}, "apiKeySecret": {"name": KEYS_SECRET}},
    }
    md = {
        "apiVersion": "serving.tokenfleet.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "lora"},
        "spec": {
            "replicas": 1,
            "cachePolicyRef": "small",
            "routingPolicyRef": "front",
            "apiKeySecret": {"name": KEYS_SECRET},
            "engine": {"maxNumSeqs": 4, "maxNumBatchedTokens": 256},
            "model": {"servedName": BASE, "maxModelLen": 512},
            "adapters": _adapters(adapters),
            # Given from the start: the pods' env carries them, so a later hf:// adapter applies live.
            "lora": {"hfEndpoint": hub_url, "hfTokenSecret": {"name": HUB_SECRET}},
        },
    }
    secrets = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": HUB_SECRET},
            "stringData": {"token": HUB_TOKEN},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": KEYS_SECRET},
            "stringData": {"keys": USER_KEY},
        },
    ]
    return yaml.safe_dump_all([cache, routing, *secrets, md])


def _adapters(names: list[str]) -> list[dict]:
    # The Hub's adapter is kept on a pod whatever requests come (minCopies: the operator pins it there).
    return [
        {"name": n, "source": HUB_SOURCE, "minCopies": 1}
        if n == "qv-c"
        else {"name": n, "source": f"pvc://{CLAIM}/{ADAPTERS[n][0]}"}
        for n in names
    ]


def _hub(folder: Path) -> FakeHub:
    """The fake Hub holding the adapter in `folder` as HUB_REPO (private: only HUB_TOKEN reads it)."""
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    return FakeHub({HUB_REPO: FakeRepo(HUB_COMMIT, files, frozenset({WEIGHTS}), True)}, token=HUB_TOKEN)


def _ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
    return conds.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp")


def _one_ready(cluster, namespace: str, selector: str) -> dict | None:
    pods = cluster.pods(namespace, selector)
    return pods[0] if len(pods) == 1 and _ready(pods[0]) else None


def _complete(base: str, model: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a short greedy completion; an HTTP error is an answer, not an exception."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _answered(base: str, model: str) -> dict | None:
    """The completion when `model` answered 200 (None on a refusal or a router not reaching a pod yet)."""
    try:
        status, body = _complete(base, model, USER)
    except OSError:  # connection refused / reset while the router starts
        return None
    return body if status == 200 else None


def _assert_not_found(status: int, body: dict, model: str, who: str) -> None:
    """OpenAI's shape: {"error": {"message", "type", "code": "model_not_found", ...}} with a 404."""
    error = body.get("error")
    assert status == 404 and isinstance(error, dict), f"{who}: {model} answered {status} {body}"
    assert error.get("code") == "model_not_found", f"{who}: {body}"
    assert isinstance(error.get("message"), str) and model in error["message"], f"{who}: {body}"
    assert isinstance(error.get("type"), str) and error["type"], f"{who}: {body}"


def _adapters_ready(cluster, namespace: str) -> dict | None:
    status = (cluster.get("md", "lora", namespace) or {}).get("status") or {}
    names = [a.get("name") for a in status.get("adapters") or []]
    pinned = [a.get("pinnedPods") for a in status.get("adapters") or []]
    done = status.get("adaptersReady") == "2/2" and names == ["qv-b", "qv-c"] and pinned == [0, 1]
    return status if done else None


def _template(cluster, namespace: str) -> tuple:
    """What a rollout changes: the template's config hash, the Deployment's generation, its ReplicaSets."""
    dep = cluster.get("deployment", "lora", namespace)
    sets = json.loads(cluster.kubectl("get", "replicasets", "-n", namespace, "-l", RUNTIME, "-o", "json"))
    return (
        dep["spec"]["template"]["metadata"]["annotations"][HASH],
        dep["metadata"]["generation"],
        sorted(rs["metadata"]["name"] for rs in sets["items"]),
    )


@pytest.mark.slow
@pytest.mark.timeout(sum(WAITS.values()) + SETUP_S)
def test_an_adapter_swapped_in_spec_is_served_through_the_router_without_a_restart(
    cluster, kubelets, namespace, pod_network, tmp_path, wait
):
    def until(what: str, predicate):
        return wait(predicate, timeout=WAITS[what], interval=0.5, what=what)

    ns = namespace
    started = time.monotonic()
    # 1. Both adapters on the claim (each node's directory for it), the claim Bound, qv-a deployed.
    for kubelet in kubelets.values():
        for folder, seed in ADAPTERS.values():
            _write_adapter(kubelet.workdir / "pvc" / ns / CLAIM / folder, seed)
    pv = f"{ns}-{CLAIM}"
    _write_adapter(tmp_path / "hub", ADAPTERS["qv-a"][1])
    hub = _hub(tmp_path / "hub")
    hub_server = serve_hub(hub, pod_network.host_ip)
    try:
        cluster.kubectl("apply", "-f", "-", stdin=_claim(ns))
        until(
            "the claim Bound",
            lambda: ((cluster.get("pvc", CLAIM, ns) or {}).get("status") or {}).get("phase") == "Bound",
        )
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=_manifests(["qv-a"], hub.url))
        pod = until("1 runtime pod Ready", lambda: _one_ready(cluster, ns, RUNTIME))
        router = until("router Ready", lambda: _one_ready(cluster, ns, ROUTER))
        ready_s = time.monotonic() - started
        front = f"http://{router['status']['podIP']}:8080"

        served = until("qv-a through the router", lambda: _answered(front, "qv-a"))
        assert served["model"] == "qv-a" and served["choices"][0]["text"], served
        qv_a_text = served["choices"][0]["text"]
        status, base = _complete(front, BASE, USER)
        assert status == 200 and base["model"] == BASE, base
        for who, url in (("router", front), ("pod", f"http://{pod['status']['podIP']}:8000")):
            status, body = _complete(url, "qv-a")  # no key
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (who, status, body)
        restarts = pod["status"]["containerStatuses"][0]["restartCount"]
        template = _template(cluster, ns)
        assert len(template[2]) == 1, template

        # 2. The swap: same claim, and an adapter from the Hub, so only the config changes; the pod and the
        # router apply it live.
        assert hub.gets(WEIGHTS) == 0
        swapped = time.monotonic()
        spec = {"spec": {"adapters": _adapters(["qv-b", "qv-c"])}}
        cluster.kubectl("patch", "md", "lora", "-n", ns, "--type=merge", "-p", json.dumps(spec))
        served = until("qv-b through the router", lambda: _answered(front, "qv-b"))
        swap_s = time.monotonic() - swapped
        assert served["model"] == "qv-b" and served["choices"][0]["text"], served
        served = until("qv-c through the router", lambda: _answered(front, "qv-c"))
        hub_s = time.monotonic() - swapped
        # The first adapter's weights, fetched from the Hub: its tokens, as it gave them from the claim.
        assert served["model"] == "qv-c" and served["choices"][0]["text"] == qv_a_text, (served, qv_a_text)
        assert hub.gets(WEIGHTS) == 1, hub.paths  # downloaded once, then served from the pod's entry
        assert f"Bearer {HUB_TOKEN}" in hub.auth_seen  # the Secret's token reached the download
        runtime = yaml.safe_load(cluster.get("configmap", "lora-runtime", ns)["data"]["runtime.yaml"])
        modules = [(m["name"], m["path"]) for m in runtime["lora"]["modules"]]
        assert modules == [("qv-b", f"/adapters/{CLAIM}/b"), ("qv-c", HUB_SOURCE)], runtime["lora"]

        # The old name is gone: the router no longer routes it, and the pod itself unloaded it.
        _assert_not_found(*_complete(front, "qv-a", USER), "qv-a", "router")
        pod_url = f"http://{pod['status']['podIP']}:8000"
        key = auth_headers(internal_key(cluster, ns, pod, runtime))
        _assert_not_found(*_complete(pod_url, "qv-a", key), "qv-a", "pod")
        models = {m["id"]: m for m in get_json(f"{pod_url}/v1/models", headers=key)["data"]}
        assert set(models) == {BASE, "qv-b", "qv-c"}, models
        assert models["qv-b"].get("parent") == models["qv-c"].get("parent") == BASE, models
        assert models["qv-c"].get("root") == HUB_SOURCE, models
        listed = {m["id"] for m in get_json(f"{front}/v1/models", headers=USER)["data"]}
        assert listed == {BASE, "qv-b", "qv-c"}, listed
        status, base = _complete(front, BASE, USER)
        assert status == 200 and base["model"] == BASE, base

        # The operator's status says so too, from the pod's own /load.
        md_status = until("status.adapters", lambda: _adapters_ready(cluster, ns))
        assert md_status["adapters"] == [
            {"name": "qv-b", "loadedPods": 1, "ready": True, "pinnedPods": 0},
            {"name": "qv-c", "loadedPods": 1, "ready": True, "pinnedPods": 1},
        ], md_status

        # 3. Nothing restarted or rolled.
        (now,) = cluster.pods(ns, RUNTIME)
        assert now["metadata"]["uid"] == pod["metadata"]["uid"], "the swap replaced the pod"
        assert now["status"]["containerStatuses"][0]["restartCount"] == restarts, now["status"]
        assert _template(cluster, ns) == template
        print(
            f"LoRA swap: deployment Ready after {ready_s:.1f}s; qv-b served through the router "
            f"{swap_s:.1f}s after the edit, qv-c from the Hub {hub_s:.1f}s after, same pod, no rollout"
        )
    finally:
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)
        hub_server.shutdown()
        hub_server.server_close()
