"""Scenario 7: the runtime pod the operator specified actually serves. Its container command, env and
ConfigMap come from the API server; a completion request reaches it over HTTP."""

from __future__ import annotations

import json
import urllib.request

from local_pod import LocalPod

MD = """
apiVersion: serving.tokenfleet.dev/v1alpha1
kind: ModelDeployment
metadata: {name: smol}
spec:
  model: {source: smollm2-135m-instruct, servedName: smol, maxModelLen: 512}
  engine: {maxNumSeqs: 4, maxNumBatchedTokens: 256}
"""


def test_pod_command_serves_a_completion(cluster, namespace, wait, tmp_path):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=MD)
    wait(lambda: cluster.get("deployment", "smol", namespace), what="deployment")
    wait(lambda: cluster.get("configmap", "smol-runtime", namespace), what="configmap")
    pod = LocalPod(cluster, namespace, "smol", tmp_path)
    pod.start(tmp_path / "pod.log")
    try:
        try:
            pod.wait_ready(timeout=120)
        except (RuntimeError, TimeoutError):
            print((tmp_path / "pod.log").read_text()[-4000:])
            raise
        body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
        req = urllib.request.Request(
            f"{pod.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.loads(resp.read())
        assert out["model"] == "smol"
        assert out["choices"][0]["text"].startswith(" Paris")
        assert out["usage"]["completion_tokens"] == 3
    finally:
        pod.stop()
