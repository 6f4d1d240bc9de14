"""Converted weights cached on disk, so the next process loading the same model skips its conversion.

Loading a checkpoint converts it: GGUF blocks are dequantised, dtypes cast, fused projections assembled, a
tensor-parallel shard sliced out. The result, the model's own state dict, is what this cache keeps: one
entry per model identity, dtype, device type and shard, as a standard safetensors file. On CPU a hit is
memory-mapped copy-on-write straight into the parameters (no read, no conversion, no copy: pages come
from the page cache as the first forward touches them, and pods of one model on a node share those
pages); on a GPU it is read straight into device memory in its final dtype.

The key is a digest of what determines the converted tensors: the checkpoint's files as the filesystem
describes them (relative name, size, modification time: a fetched entry never changes once written, and
a file rewritten in place has a new mtime; dotfiles, a downloader's own records, are left out), for a
model `tokenfleet fetch` downloaded also its files' sha256 (its verified manifest), the dtype, the device
type, the shard, and `LAYOUT_VERSION`, raised whenever a loader change alters what a parameter holds. A model whose parameters do not match an
entry's tensors exactly (names, shapes, dtypes) refuses it, and it is rebuilt.

An entry is written to a temporary directory beside the entries and renamed into place whole, so no
reader ever sees a partial one; two processes converting at once both write, the first rename wins.
Every load checks the file's size and CRC-32 against the entry's record before mapping it: a torn or
damaged entry is removed and rebuilt, never loaded (CRC-32 at ~4 GB/s: the volume's writers are the
deployment's own pods, so this guards against damage, not forgery). Writing happens after the model is
loaded, in a background thread, one tensor at a time (no second copy of the weights in memory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenfleet.runtime.model.fetch import manifest_files, read_manifest

log = logging.getLogger(__name__)

# Raised whenever a loader change alters what a parameter holds for the same checkpoint (a new fused
# layout, a different dequantisation): every entry written before is then a miss.
LAYOUT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
RECORD_FILE = "entry.json"
ENTRIES_DIR = "weights"
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 3600.0  # a temporary directory this old belongs to a writer that died
_CRC_CHUNK = 64 << 20

_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


_writers: list[threading.Thread] = []
_writers_lock = threading.Lock()


def wait_for_writes(timeout: float | None = None) -> bool:
    """Wait for this process's background writes; True when none is left running."""
    with _writers_lock:
        pending = list(_writers)
    for thread in pending:
        thread.join(timeout)
    return not any(t.is_alive() for t in pending)


class WeightCacheError(Exception):
    """An entry that cannot be used (missing, torn, damaged, or not this model's): rebuilt, never loaded."""


def checkpoint_files(path: Path) -> list[tuple[str, int, int]]:
    """(relative name, size, mtime_ns) of every file of a checkpoint (one GGUF file, or a directory)."""
    path = path.resolve()
    if path.is_file():
        st = path.stat()
        return [(path.name, st.st_size, st.st_mtime_ns)]
    out = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        name = file.relative_to(path).as_posix()
        if any(part.startswith(".") for part in name.split("/")):
            continue  # a downloader's own records (manifests, metadata it may touch again), never weights
        st = file.stat()
        out.append((name, st.st_size, st.st_mtime_ns))
    return out


def fetched_digests(checkpoint: Path) -> list[tuple[str, str]] | None:
    """(name, sha256) of each file of the `tokenfleet fetch` entry the checkpoint is in, from the entry's
    manifest (written only once every file matched the Hub's digests, and checked again by every pod's
    fetch before the server starts); None for a checkpoint that was not fetched."""
    path = checkpoint.resolve()
    entry = path if path.is_dir() else path.parent
    try:
        manifest = read_manifest(entry)
        return None if manifest is None else sorted((f.name, f.sha256) for f in manifest_files(manifest))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a manifest the fetch would refuse: the files' metadata still key the entry


def cache_key(
    checkpoint: Path, dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1
) -> str:
    """The digest naming the entry of this checkpoint converted for this dtype, device type and shard."""
    what = {
        "layout": LAYOUT_VERSION,
        "files": checkpoint_files(checkpoint),
        "sha256": fetched_digests(checkpoint),
        "dtype": str(dtype),
        "device": device.type,
        "shard": [tp_rank, tp_size],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:40]


def _crc32(path: Path) -> int:
    """Over a read-only mapping: no copy out of the page cache (reading into buffers took twice as long)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            crc = 0
            for start in range(0, len(view), _CRC_CHUNK):
                crc = zlib.crc32(view[start : start + _CRC_CHUNK], crc)
            return crc


def _unique(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to write, and the names that alias one of them (tied weights share one storage)."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for name, t in state.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ident in seen:
            aliases[name] = seen[ident]
        else:
            seen[ident] = name
            kept[name] = t
    return kept, aliases


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format, written one tensor at a time (the library's writer builds the whole file in
    memory first: a second copy of the weights)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise WeightCacheError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            host = t.detach().to("cpu").contiguous()
            if host.numel():
                f.write(host.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True, slots=True)
class WeightCache:
    """The entries under `root` (one directory per key)."""

    root: Path

    def entry(self, key: str) -> Path:
        return self.root / ENTRIES_DIR / key

    def load(self, key: str, device: torch.device) -> dict[str, torch.Tensor]:
        """The entry's tensors (aliases included) on `device`; WeightCacheError when there is none or it
        does not check — a damaged entry is removed first, so the caller's rebuild replaces it."""
        from safetensors.torch import load_file

        entry = self.entry(key)
        try:
            record = json.loads((entry / RECORD_FILE).read_text())
        except FileNotFoundError:
            raise WeightCacheError("no entry") from None
        except (OSError, ValueError) as e:
            self._remove_entry(entry, f"its record is unreadable ({e})")
            raise WeightCacheError("a damaged record") from None
        weights = entry / WEIGHTS_FILE
        try:
            size = weights.stat().st_size
            crc = _crc32(weights) if size == record.get("size") else None
        except OSError as e:
            self._remove_entry(entry, f"its weights are unreadable ({e})")
            raise WeightCacheError("unreadable weights") from None
        if size != record.get("size") or crc != record.get("crc32"):
            why = f"size {size} != {record.get('size')}" if crc is None else "its CRC-32 does not match"
            self._remove_entry(entry, why)
            raise WeightCacheError(f"a damaged entry ({why})")
        tensors = load_file(weights, device=str(device) if device.type != "cpu" else "cpu")
        for name, target in (record.get("aliases") or {}).items():
            tensors[name] = tensors[target]
        return tensors

    def store(self, key: str, state: dict[str, torch.Tensor], source: str) -> Path | None:
        """Write `state` as the entry `key` (no-op when one exists); the entry, or None when it lost a race
        or could not be written (a full or read-only volume costs the next start its conversion, nothing
        more: logged)."""
        final = self.entry(key)
        if final.exists():
            return None
        parent = final.parent
        tmp = parent / f"{TMP_PREFIX}{key}-{uuid.uuid4().hex[:8]}"
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._sweep(parent)
            tmp.mkdir()
            kept, aliases = _unique(state)
            started = time.monotonic()
            write_safetensors(tmp / WEIGHTS_FILE, kept, {"source": source, "key": key})
            weights = tmp / WEIGHTS_FILE
            record = {
                "key": key,
                "source": source,
                "size": weights.stat().st_size,
                "crc32": _crc32(weights),
                "aliases": aliases,
                "layout": LAYOUT_VERSION,
            }
            (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1))
            try:
                os.rename(tmp, final)
            except OSError:  # another process's entry landed first: theirs is as good
                shutil.rmtree(tmp, ignore_errors=True)
                return None
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("weight cache: %s not written to %s: %s", source, parent, e)
            return None
        log.info(
            "weight cache: stored %s (%.1f MiB) in %.2f s",
            final.name, record["size"] / 2**20, time.monotonic() - started,
        )  # fmt: skip
        return final

    def store_in_background(self, key: str, state: dict[str, torch.Tensor], source: str) -> threading.Thread:
        """`store` on a daemon thread: serving starts at once; a process that exits first leaves only a
        temporary directory, swept by a later writer."""
        thread = threading.Thread(
            target=self.store, args=(key, state, source), name="weight-cache", daemon=True
        )
        with _writers_lock:
            _writers[:] = [t for t in _writers if t.is_alive()]
            _writers.append(thread)
        thread.start()
        return thread

    def remove(self, key: str, why: str) -> None:
        """Take the entry away (one the model refused): the next store writes it anew."""
        self._remove_entry(self.entry(key), why)

    @staticmethod
    def _remove_entry(entry: Path, why: str) -> None:
        log.warning("weight cache: entry %s removed, to be rebuilt: %s", entry.name, why)
        # Renamed away first: a reader that mapped it keeps its mapping, and nobody finds it half-deleted.
        doomed = entry.parent / f"{TMP_PREFIX}{entry.name}-removed-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(entry, doomed)
        except OSError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    @staticmethod
    def _sweep(parent: Path) -> None:
        now = time.time()
        for tmp in parent.glob(f"{TMP_PREFIX}*"):
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                    shutil.rmtree(tmp, ignore_errors=True)
            except OSError:
                continue
