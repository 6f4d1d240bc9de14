"""What a real API server stores of the objects that guard a ModelDeployment's pods: the internal-key
Secret (created once; a spec change does not rotate it), the NetworkPolicy (accepted, owned, removed when
turned off) and the PodDisruptionBudget. The harness's bridge does not enforce NetworkPolicies: what they
admit is tested offline (tests/operator/test_network_policy.py). Zero replicas: no model is loaded.
"""

from __future__ import annotations

import json


def _md(name: str, **spec) -> str:
    body = {
        "apiVersion": "serving.tokenfleet.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"replicas": 0, **spec},
    }
    return json.dumps(body)


def _patch(cluster, namespace: str, name: str, spec: dict) -> None:
    cluster.kubectl("patch", "md", name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec}))


def test_the_key_policy_and_budget_are_stored_owned_and_the_key_survives_a_spec_change(
    cluster, operator, namespace, wait
):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_md("chat"))
    dep = wait(lambda: cluster.get("deployment", "chat", namespace), what="deployment chat")
    uid = cluster.get("md", "chat", namespace)["metadata"]["uid"]
    secret = cluster.get("secret", "chat-internal-key", namespace)
    policy = wait(lambda: cluster.get("networkpolicy", "chat", namespace), what="networkpolicy chat")
    budget = wait(lambda: cluster.get("pdb", "chat", namespace), what="pdb chat")
    for obj in (secret, policy, budget):
        assert [(o["kind"], o["uid"]) for o in obj["metadata"]["ownerReferences"]] == [
            ("ModelDeployment", uid)
        ]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["internal-key"]["secret"]["secretName"] == "chat-internal-key"

    # A spec change (here one that rolls the pods) and the resyncs after it leave the key as it was.
    key = secret["data"]["key"]
    _patch(cluster, namespace, "chat", {"engine": {"maxNumSeqs": 3}})
    wait(
        lambda: (
            ((md := cluster.get("md", "chat", namespace)).get("status") or {}).get("observedGeneration")
            == md["metadata"]["generation"]
        ),
        what="the edit reconciled",
    )
    assert cluster.get("secret", "chat-internal-key", namespace)["data"]["key"] == key

    # Turned off, the policy goes and the rest stays; back on, it returns.
    _patch(cluster, namespace, "chat", {"networkPolicy": {"enabled": False}})
    wait(lambda: cluster.get("networkpolicy", "chat", namespace) is None, what="the policy removed")
    assert cluster.get("pdb", "chat", namespace) is not None
    _patch(
        cluster,
        namespace,
        "chat",
        {"networkPolicy": {"enabled": True, "allowFrom": [{"ipBlock": {"cidr": "10.8.0.0/16"}}]}},
    )
    policy = wait(lambda: cluster.get("networkpolicy", "chat", namespace), what="the policy back")
    assert {"ipBlock": {"cidr": "10.8.0.0/16"}} in policy["spec"]["ingress"][0]["from"]

    # The CRD refuses an entry that is neither selectors nor an ipBlock alone, naming the field.
    bad = {"spec": {"networkPolicy": {"allowFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}}}
    refused = cluster.kubectl(
        "patch", "md", "chat", "-n", namespace, "--type=merge", "-p", json.dumps(bad), check=False
    )
    assert "networkPolicy.allowFrom" in str(refused)
