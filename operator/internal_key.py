"""The internal key of a ModelDeployment: one random secret its pods and its routers share.

Router -> pod calls (proxied requests, KV events, load, holds, tokenizer) and the decode pods' KV fetches
from the prefill pods carry it, so nothing else that can reach a pod can use the internal endpoints or
claim a tenant. It lives in the Secret `<name>-internal-key` (entry `key`), owned by the ModelDeployment:

- created once, if absent (`secrets.token_urlsafe(32)`), and never written again by a reconcile: a
  restarted operator, a resync or a spec change must not rotate it under running pods. An admin rotates
  it by replacing the Secret's data (or deleting it: the next reconcile makes a new one);
- mounted whole (no subPath, so the kubelet's updates reach the file) into every runtime pod of the
  deployment, both roles of a disaggregated one, at `INTERNAL_KEY_DIR/key` (`server.internal_api_key_file`);
- mounted into the router pods of the RoutingPolicy that routes to it, one projected source per backend
  ModelDeployment at `INTERNAL_KEY_DIR/<md>/key` (each router Backend's `internal_key_file`).

Pure: the builders here make manifest dicts; reconcile.py creates the Secret.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterable
from typing import Any

INTERNAL_KEY_DIR = "/etc/tokenfleet-internal"
INTERNAL_KEY_ENTRY = "key"
VOLUME = "internal-key"
ROUTER_VOLUME = "internal-keys"
# Owner and group read only: the key is a credential.
_MODE = 0o440


def internal_key_secret_name(md_name: str) -> str:
    return f"{md_name}-internal-key"


def new_internal_key() -> str:
    return secrets.token_urlsafe(32)


def build_internal_key_secret(md_name: str, labels: dict[str, str], key: str) -> dict[str, Any]:
    """The Secret as first created (the caller passes a fresh `new_internal_key()`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": internal_key_secret_name(md_name), "labels": dict(labels)},
        "type": "Opaque",
        "data": {INTERNAL_KEY_ENTRY: base64.b64encode(key.encode()).decode()},
    }


def pod_key_path() -> str:
    """Where a runtime pod reads its deployment's key."""
    return f"{INTERNAL_KEY_DIR}/{INTERNAL_KEY_ENTRY}"


def pod_key_volume(md_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, volumeMount) of a runtime pod: the whole Secret, never a subPath (it would freeze the file).

    Not optional: the reconcile creates the Secret before the Deployment, and a pod that started without
    its key could not talk to its peers.
    """
    volume = {
        "name": VOLUME,
        "secret": {"secretName": internal_key_secret_name(md_name), "defaultMode": _MODE},
    }
    return volume, {"name": VOLUME, "mountPath": INTERNAL_KEY_DIR, "readOnly": True}


def router_key_path(md_name: str) -> str:
    """Where a router reads the key of backend ModelDeployment `md_name`."""
    return f"{INTERNAL_KEY_DIR}/{md_name}/{INTERNAL_KEY_ENTRY}"


def router_key_volume(md_names: Iterable[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) of a router pod: one projected volume, one source per backend deployment
    (a disaggregated one has two backends and one key), so the mount path stays fixed however many.

    Each source is optional: a router must start (and serve its other models) while a new deployment's
    Secret is still being created; the kubelet fills the file in when the Secret appears.
    """
    names = sorted(set(md_names))
    if not names:
        return [], []
    sources = [
        {
            "secret": {
                "name": internal_key_secret_name(name),
                "items": [{"key": INTERNAL_KEY_ENTRY, "path": f"{name}/{INTERNAL_KEY_ENTRY}"}],
                "optional": True,
            }
        }
        for name in names
    ]
    volume = {"name": ROUTER_VOLUME, "projected": {"sources": sources, "defaultMode": _MODE}}
    return [volume], [{"name": ROUTER_VOLUME, "mountPath": INTERNAL_KEY_DIR, "readOnly": True}]


def read_internal_key(kube: Any, namespace: str, md_name: str) -> str | None:
    """The deployment's internal key (its Secret), or None when there is none yet: what the operator's own
    calls to its pods (sleep and wake, adapter pins) authenticate with."""
    secret = kube.get("Secret", namespace, internal_key_secret_name(md_name))
    data = (secret or {}).get("data") or {}
    if INTERNAL_KEY_ENTRY not in data:
        return None
    return base64.b64decode(data[INTERNAL_KEY_ENTRY]).decode().strip() or None
