"""A pod's volumes as local directories, in the layout the kubelet gives them.

ConfigMap, Secret, downward-API and projected volumes use the kubelet's atomic writer: the files live in a
timestamped `..YYYY_MM_DD_hh_mm_ss.N` directory, `..data` is a symlink to it, and each top-level name is a
symlink through `..data`. An update writes a new timestamped directory and renames a fresh symlink over
`..data` (one atomic step), so a reader sees the old files or the new ones, never a mix — and a watcher
that follows the file's path sees its resolved target move (what the runtime's live reload keys on).
`refresh()` rewrites a volume when its sources changed. emptyDir is a fresh directory; hostPath is the
host path itself; a PersistentVolumeClaim is a directory per claim shared by the session's pods.
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pod_env import Getter, PodSpecError, field_value, resource_value

TOKEN_REFRESH_FRACTION = 0.8


def atomic_write(root: Path, files: dict[str, bytes], mode: int = 0o644) -> bool:
    """Make `root` hold exactly `files` (relative path -> bytes) in the `..data` layout; True if changed."""
    root.mkdir(parents=True, exist_ok=True)
    data_link = root / "..data"
    if data_link.is_symlink():
        current = root / os.readlink(data_link)
        old = {str(p.relative_to(current)): p.read_bytes() for p in current.rglob("*") if p.is_file()}
        if old == files:
            return False
    else:
        current = None
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + str(time.monotonic_ns() % 10**9)
    fresh = root / stamp
    fresh.mkdir()
    for rel, content in files.items():
        path = fresh / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)
    tmp = root / "..data_tmp"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(stamp)
    tmp.rename(data_link)
    tops = {rel.split("/", 1)[0] for rel in files}
    for top in tops:
        link = root / top
        if not link.is_symlink():
            link.symlink_to(f"..data/{top}")
    for entry in root.iterdir():
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in tops:
            entry.unlink()
    if current is not None:
        shutil.rmtree(current, ignore_errors=True)
    return True


@dataclass
class Volumes:
    """The volumes of one pod, materialised under `root`; `refresh()` keeps the projected ones current."""

    pod: dict[str, Any]
    root: Path
    pvc_root: Path
    get_object: Getter
    request_token: Any  # async (namespace, service account, spec) -> (token, expiration epoch)
    allocatable: dict[str, str]
    paths: dict[str, Path] = field(default_factory=dict)
    _tokens: dict[str, tuple[str, float, float]] = field(default_factory=dict)

    async def setup(self) -> None:
        for volume in self.pod["spec"].get("volumes") or []:
            self.paths[volume["name"]] = await self._setup_one(volume)

    async def refresh(self) -> None:
        for volume in self.pod["spec"].get("volumes") or []:
            if any(k in volume for k in ("configMap", "secret", "downwardAPI", "projected")):
                await self._setup_one(volume)

    async def _setup_one(self, volume: dict[str, Any]) -> Path:
        name = volume["name"]
        if "emptyDir" in volume:
            path = self.root / "empty-dir" / name
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o1777)  # world-writable like a fresh emptyDir (sticky, as /tmp)
            return path
        if "hostPath" in volume:
            host = volume["hostPath"]
            path = Path(host["path"])
            kind = host.get("type") or ""
            if kind == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            elif kind in ("Directory", "File") and not path.exists():
                raise PodSpecError(f"hostPath type check failed: {path} is not a {kind.lower()}")
            return path
        if "persistentVolumeClaim" in volume:
            ns = self.pod["metadata"]["namespace"]
            path = self.pvc_root / ns / volume["persistentVolumeClaim"]["claimName"]
            path.mkdir(parents=True, exist_ok=True)
            return path
        path = self.root / "projected" / name
        files: dict[str, bytes] = {}
        if "configMap" in volume:
            files = await self._object_files("configmaps", volume["configMap"])
        elif "secret" in volume:
            ref = {**volume["secret"], "name": volume["secret"]["secretName"]}
            files = await self._object_files("secrets", ref)
        elif "downwardAPI" in volume:
            files = self._downward_files(volume["downwardAPI"].get("items") or [])
        elif "projected" in volume:
            for source in volume["projected"].get("sources") or []:
                files.update(await self._projected_files(source))
        else:
            kinds = sorted(set(volume) - {"name"})
            raise PodSpecError(f"volume {name}: unsupported volume source {kinds}")
        mode = (volume.get("secret") or volume.get("configMap") or volume.get("projected") or {}).get(
            "defaultMode", 0o644
        )
        atomic_write(path, files, mode)
        return path

    async def _object_files(self, kind: str, ref: dict[str, Any]) -> dict[str, bytes]:
        ns = self.pod["metadata"]["namespace"]
        obj = await self.get_object(kind, f"{ns}/{ref['name']}")
        if obj is None:
            if ref.get("optional"):
                return {}
            raise PodSpecError(f'{kind[:-1]} "{ref["name"]}" not found')
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()} if kind == "configmaps" else {}
        if kind == "secrets":
            data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        items = ref.get("items")
        if not items:
            return data
        out = {}
        for item in items:
            if item["key"] not in data:
                if ref.get("optional"):
                    continue
                raise PodSpecError(f"{kind[:-1]} {ref['name']} has no key {item['key']}")
            out[item["path"]] = data[item["key"]]
        return out

    def _downward_files(self, items: list[dict[str, Any]]) -> dict[str, bytes]:
        out = {}
        for item in items:
            if "fieldRef" in item:
                value = field_value(self.pod, item["fieldRef"]["fieldPath"])
            else:
                value = resource_value(self.pod, "", item["resourceFieldRef"], self.allocatable)
            out[item["path"]] = value.encode()
        return out

    async def _projected_files(self, source: dict[str, Any]) -> dict[str, bytes]:
        if "configMap" in source:
            return await self._object_files("configmaps", source["configMap"])
        if "secret" in source:
            return await self._object_files("secrets", source["secret"])
        if "downwardAPI" in source:
            return self._downward_files(source["downwardAPI"].get("items") or [])
        if "serviceAccountToken" in source:
            spec = source["serviceAccountToken"]
            return {spec["path"]: (await self._token(spec)).encode()}
        raise PodSpecError(f"unsupported projected source {sorted(source)}")

    async def _token(self, spec: dict[str, Any]) -> str:
        """A bound ServiceAccount token (TokenRequest API), renewed at 80% of its lifetime as kubelets do."""
        key = f"{spec.get('audience', '')}/{spec.get('expirationSeconds', 3600)}"
        cached = self._tokens.get(key)
        now = time.time()
        if cached and now < cached[1] + (cached[2] - cached[1]) * TOKEN_REFRESH_FRACTION:
            return cached[0]
        token, expires = await self.request_token(self.pod, spec)
        self._tokens[key] = (token, now, expires)
        return token
