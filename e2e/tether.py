"""Harness processes that die with the test session, however it ends.

The control plane, the operator and the process kubelet run in sessions of their own (a Ctrl-C at the
terminal must not reach them before the harness stops them in order), so nothing ties them to pytest: a
pytest killed with SIGKILL, or by an out-of-memory kill, would leave etcd, the API server and the rest
running. `tethered(cmd)` runs `cmd` under util-linux's `setpriv --pdeathsig`, which asks the kernel to
send it a signal when its parent goes away (`setpriv` then execs the command, so the pid is the
command's). The kernel ties that signal to the *thread* that forked the child, so a command started
from any other thread than the main one is left as it is: a worker thread exiting would stop it early.

Which signal: SIGTERM for what cleans up after itself (the kubelet stops its pods, the operator lets go
of its watches); SIGKILL for the control plane, whose data is the dead session's anyway: told to stop
all at once, the API server's graceful shutdown waits for the etcd that stopped with it, and hangs.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

SETPRIV = shutil.which("setpriv")
_PREFIX_LEN = 4  # setpriv --pdeathsig SIGNAL --


def tethered(cmd: Sequence[str], signal: str = "TERM") -> list[str]:
    """`cmd` made to receive `signal` (a name: TERM, KILL) when this process dies; unchanged off the main
    thread or without setpriv, where the harness's own teardown and the kubelet's owner check are all
    there is."""
    if SETPRIV is None or threading.current_thread() is not threading.main_thread():
        return list(cmd)
    return [SETPRIV, "--pdeathsig", signal, "--", *cmd]


def program(args: Sequence[str]) -> str:
    """The name of the program a (possibly tethered) command line runs, for logs and error messages."""
    if SETPRIV is not None and len(args) > _PREFIX_LEN and args[0] == SETPRIV:
        args = args[_PREFIX_LEN:]
    return Path(args[0]).name
