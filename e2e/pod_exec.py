"""The container's first moment: runs inside the pod's network namespace and its own mount namespace
(`ip netns exec NS unshare --mount --uts --propagation private -- python pod_exec.py SPEC`), bind-mounts the
pod's volumes onto the paths the pod spec names, then execs the container's command unchanged.

The mounts are private to this mount namespace: the host and the other pods never see them, and they
vanish with the last process inside. The process keeps this pid through the exec, so the kubelet's
signals (SIGTERM on deletion, SIGKILL after the grace period) reach the container's process itself.
Exit code 128 with a message on stderr means the container could not start (a mount failed, the command
was not found), as a container runtime reports it.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source is not None else None
    if _libc.mount(src, target.encode(), None, flags, None) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    socket.sethostname(spec["hostname"])  # its own UTS namespace: the pod's name, as in a cluster
    # Every source is opened before the first mount: a mount on /tmp (an emptyDir) would otherwise hide
    # the sources that live under /tmp. The bind then goes through /proc/self/fd, which reaches the opened
    # directory whatever now covers its path.
    sources = []
    for mount in spec["mounts"]:
        try:
            sources.append(os.open(mount["source"], os.O_PATH))
        except OSError as e:
            print(f"failed to mount {mount['source']} at {mount['target']}: {e.strerror}", file=sys.stderr)
            sys.exit(128)
    image_fds = [os.open(path, os.O_PATH) for path in spec.get("image", [])]
    for mount, fd in zip(spec["mounts"], sources, strict=True):
        try:
            _mount(f"/proc/self/fd/{fd}", mount["target"], MS_BIND | MS_REC)
            if mount.get("readOnly"):
                _mount(None, mount["target"], MS_BIND | MS_REMOUNT | MS_RDONLY)
        except OSError as e:
            print(f"failed to mount {mount['source']} at {mount['target']}: {e.strerror}", file=sys.stderr)
            sys.exit(128)
        os.close(fd)
    # The image's own paths (the installed code) stay visible under a volume that covers them: a pod whose
    # emptyDir sits on /tmp must still find a checkout under /tmp, as a container finds its image's files.
    for path, fd in zip(spec.get("image", []), image_fds, strict=True):
        if any(path == m["target"] or path.startswith(m["target"].rstrip("/") + "/") for m in spec["mounts"]):
            try:
                os.makedirs(path, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", path, MS_BIND | MS_REC)
            except OSError as e:
                print(f"failed to keep the image path {path}: {e.strerror}", file=sys.stderr)
                sys.exit(128)
        os.close(fd)
    if spec.get("workingDir"):
        os.chdir(spec["workingDir"])
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as e:
        print(f'exec: "{argv[0]}": {e.strerror}', file=sys.stderr)
        sys.exit(128)


if __name__ == "__main__":
    main(sys.argv[1])
