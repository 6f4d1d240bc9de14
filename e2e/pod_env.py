"""What the kubelet computes from a pod spec before a process starts: downward-API fields, resource
fields, the container's environment (`value`, `valueFrom`, `envFrom`, `$(VAR)` expansion) and argv.

The container runs what the image would hold instead of pulling it: PATH starts with the bin directory of
the image payload (image_payload.py: the wheel the Dockerfile's build stage makes, installed in a venv of
its own), so a pod command of `tokenfleet serve ...` resolves to the wheel's entrypoint unchanged. That is
the one substitution the harness makes.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SUFFIX = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9.]+(?:[eE][-+]?[0-9]+)?)([a-zA-Z]*)$")
_LABEL_KEY = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodSpecError(ValueError):
    """The pod cannot start as specified (a missing ConfigMap key, an unknown field path)."""


def quantity(text: str | int | float) -> Decimal:
    match = _QUANTITY.match(str(text))
    if not match or match.group(2) not in _SUFFIX:
        raise PodSpecError(f"not a quantity: {text!r}")
    return Decimal(match.group(1)) * Decimal(_SUFFIX[match.group(2)])


def field_value(pod: dict[str, Any], path: str, pod_ip: str | None = None, host_ip: str | None = None) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip or "",
        "status.podIPs": pod_ip or "",
        "status.hostIP": host_ip or "",
        "status.hostIPs": host_ip or "",
    }
    if path in simple:
        return simple[path]
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    if match := _LABEL_KEY.match(path):
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    raise PodSpecError(f"unsupported fieldRef {path!r}")


def resource_value(
    pod: dict[str, Any], container_name: str, ref: dict[str, Any], allocatable: dict[str, str]
) -> str:
    container = next(
        c for c in _all_containers(pod) if c["name"] == (ref.get("containerName") or container_name)
    )
    kind, _, name = ref["resource"].partition(".")
    resources = container.get("resources") or {}
    value = (resources.get(kind) or {}).get(name)
    if value is None and kind == "limits":  # an unset limit reads as the node's allocatable
        value = allocatable.get(name, "0")
    if value is None:
        value = "0"
    divisor = quantity(ref.get("divisor") or "1")
    return str(math.ceil(quantity(value) / divisor))


def _all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names are replaced, unknown ones kept, `$$` escapes."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, text)


Getter = Callable[[str, str], Awaitable[dict[str, Any] | None]]


async def container_env(
    pod: dict[str, Any],
    container: dict[str, Any],
    get_object: Getter,
    api_host: str,
    api_port: int,
    pod_ip: str,
    host_ip: str,
    allocatable: dict[str, str],
    image_bin: str,
) -> dict[str, str]:
    """The process environment: base + service env + envFrom + env, in the kubelet's order. `image_bin`
    (the payload's scripts) comes first on PATH, as the image's Python does."""
    ns = pod["metadata"]["namespace"]
    env = {
        "PATH": f"{image_bin}:{SYSTEM_PATH}",
        "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"],
        "KUBERNETES_SERVICE_HOST": api_host,
        "KUBERNETES_SERVICE_PORT": str(api_port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(api_port),
        "KUBERNETES_PORT": f"tcp://{api_host}:{api_port}",
    }

    async def key_of(kind: str, ref: dict[str, Any]) -> str | None:
        obj = await get_object(kind, f"{ns}/{ref['name']}")
        data = _data(obj) if obj else None
        if data is None or ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise PodSpecError(f"couldn't find key {ref['key']} in {kind} {ns}/{ref['name']}")
        return data[ref["key"]]

    for source in container.get("envFrom") or []:
        kind, ref = ("configmaps", source["configMapRef"]) if "configMapRef" in source else (
            "secrets", source["secretRef"])  # fmt: skip
        obj = await get_object(kind, f"{ns}/{ref['name']}")
        if obj is None and not ref.get("optional"):
            raise PodSpecError(f"{kind} {ns}/{ref['name']} not found")
        for key, value in (_data(obj) or {}).items():
            env[source.get("prefix", "") + key] = value
    for var in container.get("env") or []:
        if "valueFrom" not in var:
            env[var["name"]] = expand(var.get("value", ""), env)
            continue
        src = var["valueFrom"]
        if "fieldRef" in src:
            value = field_value(pod, src["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in src:
            value = resource_value(pod, container["name"], src["resourceFieldRef"], allocatable)
        elif "configMapKeyRef" in src:
            value = await key_of("configmaps", src["configMapKeyRef"])
        elif "secretKeyRef" in src:
            value = await key_of("secrets", src["secretKeyRef"])
        else:
            raise PodSpecError(f"env {var['name']}: unsupported valueFrom {sorted(src)}")
        if value is not None:
            env[var["name"]] = value
    return env


def container_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    argv = [expand(a, env) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    if not argv:
        raise PodSpecError(f"container {container['name']}: no command (an image's entrypoint is not known)")
    return argv


def _data(obj: dict[str, Any] | None) -> dict[str, str] | None:
    """A ConfigMap's or Secret's string data (Secret values are base64 on the wire)."""
    if obj is None:
        return None
    if obj.get("kind") == "Secret":
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
    out = dict(obj.get("data") or {})
    out.update(
        {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("binaryData") or {}).items()}
    )
    return out
