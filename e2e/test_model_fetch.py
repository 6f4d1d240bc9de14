"""An hf:// model on a real cluster, as a cluster admin deploys one: a private repository (token from a
Secret), a Hub mirror (`hfEndpoint`), the node cache. The Hub is a stand-in on the session's bridge
(fake_hub.py: what huggingface_hub asks for; no internet here), serving the built-in model's GGUF file as a
repository of its own, at a bounded rate so the download takes a few seconds.

1. the first pod downloads; meanwhile `status.loading` shows the download with its bytes and percent;
   the pod serves the same greedy tokens as the same file loaded directly (the offline engine, here);
2. a second pod on a node with the entry downloads nothing (the Hub sees no second file GET), and maps
   the weights the first pod converted (its start-up has no conversion) instead of dequantising again;
3. a byte of the cached file flipped on the node, the next pod's fetch finds the digest wrong, downloads
   again and serves the same tokens: a corrupt entry is never loaded;
4. a repository that does not exist: the ModelDeployment's Ready condition carries the fetch's reason.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import yaml
from fake_hub import FakeHub, FakeRepo, serve_hub
from workload import post_json

WAITS = {
    "first pod Ready": 240,
    "converted weights cached": 60,
    "second pod Ready": 180,
    "replacement Ready": 180,
    "the fetch's reason": 120,
}
SETUP_S = 120
REPO = "tinyorg/smol-gguf"
COMMIT = "c0ffee" + "0" * 34
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKEN = "hf_e2eTokenNeverLogged"
RATE = 16 << 20  # bytes/s: the ~98 MB file takes ~6 s, so the operator's 5 s status tick sees it
RUNTIME = "app.kubernetes.io/instance=fetched,app.kubernetes.io/component=runtime"
PROMPT = "The capital of France is"


def _builtin_gguf() -> Path:
    from tokenfleet.runtime.model.source import builtin_model_path

    return builtin_model_path("smollm2-135m-instruct")


def _reference(path: Path) -> str:
    """The same file loaded directly, greedy: what the fetched model must serve."""
    from tokenfleet.runtime.engine.llm import LLM
    from tokenfleet.runtime.engine.sampling_params import SamplingParams

    llm = LLM(model=str(path))
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text


def _model_deployment(name: str, repo: str, endpoint: str, replicas: int) -> dict:
    return {
        "apiVersion": "serving.tokenfleet.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "model": {
                "source": f"hf://{repo}",
                "nodeCache": True,
                "hfEndpoint": endpoint,
                "hfTokenSecret": {"name": "hf-token"},
            },
        },
    }


def _ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
    return conds.get("Ready") == "True"


def _complete(pod: dict) -> str:
    body = {"model": REPO, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    answer, _ = post_json(f"http://{pod['status']['podIP']}:8000/v1/completions", body, timeout=120)
    return answer["choices"][0]["text"]


def _startup_phases(kubelets, ns: str, pod: dict) -> dict[str, float]:
    """The server's own `startup:` line from the pod's container log, as its node's kubelet wrote it."""
    from tokenfleet.runtime.startup_timing import parse_line

    for kubelet in kubelets.values():
        path = kubelet.workdir / "logs" / f"{ns}_{pod['metadata']['name']}" / "runtime-0.log"
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if (record := parse_line(line)) is not None:
                    return record["phases"]
    raise AssertionError(f"no startup line in {pod['metadata']['name']}'s log")


@pytest.mark.slow
@pytest.mark.timeout(sum(WAITS.values()) + SETUP_S)
def test_an_hf_model_is_fetched_once_per_node_verified_and_its_progress_shown(
    cluster, kubelets, namespace, pod_network, operator, wait
):
    def until(what: str, predicate):
        return wait(predicate, timeout=WAITS[what], interval=0.5, what=what)

    ns = namespace
    data = _builtin_gguf().read_bytes()
    repo = FakeRepo(
        COMMIT, {FILE: data, "README.md": b"# smol, as its own repository\n"}, frozenset({FILE}), True
    )
    hub = FakeHub({REPO: repo}, token=TOKEN, rate_bytes_per_s=RATE)
    server = serve_hub(hub, pod_network.host_ip)
    try:
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"},
                  "stringData": {"token": TOKEN}}  # fmt: skip
        md = _model_deployment("fetched", REPO, hub.url, replicas=1)
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([secret, md]))

        # 1. The download, as the status shows it, then the pod serves the file's own tokens.
        stages: list[dict] = []

        def first_ready():
            loading = ((cluster.get("md", "fetched", ns) or {}).get("status") or {}).get("loading") or []
            stages.extend(loading)
            pods = cluster.pods(ns, RUNTIME)
            return len(pods) == 1 and _ready(pods[0]) and pods[0]

        started = time.monotonic()
        pod = until("first pod Ready", first_ready)
        first_s = time.monotonic() - started
        downloads = [s for s in stages if s["stage"] == "download" and s.get("totalBytes")]
        assert downloads, f"status.loading never showed the download: {stages}"
        total = sum(map(len, repo.files.values()))  # the whole repository's bytes
        assert downloads[-1]["totalBytes"] == total and 0 <= downloads[-1]["percent"] <= 100, downloads
        assert hub.gets(FILE) == 1
        assert set(hub.auth_seen) == {f"Bearer {TOKEN}"}, list(zip(hub.paths, hub.auth_seen, strict=True))[:4]
        expected = _reference(_builtin_gguf())
        assert _complete(pod) == expected

        # The first server converted the GGUF (dequantised it) and keeps the result on the cache volume.
        assert "weight_copy" in _startup_phases(kubelets, ns, pod)
        # In the deployment's own directory of the node cache, the one part of it its pods can write.
        work = operator.node_cache_dir / "deployments" / ns / "fetched"
        until("converted weights cached", lambda: list((work / "weights").glob("*/entry.json")))

        # 2. A second pod: the node's entry is verified and used, and so are the converted weights: nothing
        # is downloaded or converted again, and it serves the same tokens from the mapped entry.
        cluster.kubectl("patch", "md", "fetched", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":2}}')
        started = time.monotonic()
        pods = until("second pod Ready", lambda: (p := cluster.pods(ns, RUNTIME)) and len(p) == 2
                     and all(_ready(x) for x in p) and p)  # fmt: skip
        second_s = time.monotonic() - started
        assert hub.gets(FILE) == 1, "the second pod downloaded the model again"
        assert all(_complete(p) == expected for p in pods)
        second = next(p for p in pods if p["metadata"]["name"] != pod["metadata"]["name"])
        phases = _startup_phases(kubelets, ns, second)
        assert "weight_cache" in phases and "weight_copy" not in phases, phases

        # 3. A corrupt entry is found by its digest and fetched again, never loaded.
        (entry,) = (operator.node_cache_dir / "hf" / REPO).glob(f"{COMMIT}/{FILE}")
        raw = bytearray(entry.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        entry.write_bytes(bytes(raw))
        gone = pods[0]["metadata"]["name"]
        cluster.kubectl("delete", "pod", gone, "-n", ns, "--wait=false")
        until("replacement Ready", lambda: (p := cluster.pods(ns, RUNTIME)) and len(p) == 2
              and gone not in [x["metadata"]["name"] for x in p] and all(_ready(x) for x in p))  # fmt: skip
        assert hub.gets(FILE) == 2, "the corrupt entry was not fetched again"
        assert hashlib.sha256(entry.read_bytes()).digest() == hashlib.sha256(data).digest()
        new = next(
            p for p in cluster.pods(ns, RUNTIME) if p["metadata"]["name"] != pods[1]["metadata"]["name"]
        )
        assert _complete(new) == expected

        # 4. A repository that does not exist: the fetch's own reason reaches the ModelDeployment.
        missing = _model_deployment("missing", "tinyorg/no-such-model", hub.url, replicas=1)
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(missing))

        def reason():
            status = (cluster.get("md", "missing", ns) or {}).get("status") or {}
            ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
            return "fetch-model" in ready.get("message", "") and "not found" in ready["message"] and ready

        ready = until("the fetch's reason", reason)
        assert TOKEN not in ready["message"]
        print(f"hf:// model ({len(data) / 2**20:.0f} MiB at {RATE / 2**20:.0f} MiB/s): first pod Ready after "
              f"{first_s:.1f}s (download included), a second pod on the cached node after {second_s:.1f}s; "
              f"status.loading stages seen: {sorted({s['stage'] for s in stages})}")  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
