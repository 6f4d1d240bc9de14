"""The deployment's internal key as the harness finds it, to read a pod's internal endpoints (/v1/config).

A pod's `server.internal_api_key_file` names a file inside the pod's own mount namespace (a mounted
Secret), which the harness cannot open by that path. So the key is read where the kubelet reads it from:
the container's volume mount covering that path -> the Secret volume -> the Secret's data. A pod whose
config names no internal key file (or whose volume is not a Secret) gets None: the request goes without
a key, as pods without one accept.
"""

from __future__ import annotations

import base64
import posixpath
from typing import Any

from tokenfleet.runtime.key_file import key_lines


def _secret_item(pod: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(secret name, data key) of the file at `path` in the pod's first container, or None."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    for mount in pod["spec"]["containers"][0].get("volumeMounts") or []:
        base = mount["mountPath"].rstrip("/")
        if mount.get("subPath"):
            rel = mount["subPath"] if path == base else None
        elif path.startswith(base + "/"):
            rel = posixpath.relpath(path, base)
        else:
            rel = None
        secret = (volumes.get(mount["name"]) or {}).get("secret")
        if rel is None or secret is None:
            continue
        by_path = {item["path"]: item["key"] for item in secret.get("items") or []}
        return secret["secretName"], by_path.get(rel, rel)
    return None


def internal_key(cluster, namespace: str, pod: dict[str, Any], runtime_config: dict[str, Any]) -> str | None:
    """The key in the Secret behind the pod's `server.internal_api_key_file`, or None when it names none."""
    path = (runtime_config.get("server") or {}).get("internal_api_key_file")
    item = _secret_item(pod, path) if path else None
    if item is None:
        return None
    secret = cluster.get("secret", item[0], namespace)
    raw = ((secret or {}).get("data") or {}).get(item[1])
    if raw is None:
        return None
    lines = key_lines(base64.b64decode(raw).decode())
    return lines[0] if lines else None


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}
