"""Process-local runtime facts: private socket directory, instance prefixes, liveness."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import Callable

_RUNTIME_ENV = "MPP_IPC_RUNTIME_DIR"
_DIR_PREFIX = "mpp-ipc-"  # then `<creator pid>.<its PID namespace>-<random>`
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def runtime_dir() -> str:
    """A private (0700) directory for `ipc://` socket files, created on first use.

    Children inherit the path through the environment, so every process of one
    tree agrees on it. Its creator removes it at exit; the one creating a new directory
    removes this user's directories whose creator is gone (killed at once).
    """
    path = os.environ.get(_RUNTIME_ENV)
    if path is None:
        sweep_stale_dirs()
        path = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}.{pid_namespace()}-")
        os.environ[_RUNTIME_ENV] = path
        creator = os.getpid()
        atexit.register(lambda: os.getpid() == creator and shutil.rmtree(path, True))
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def sweep_stale_dirs() -> list[str]:
    """Remove this user's runtime directories whose creating process (in this PID
    namespace) no longer runs."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    stale = [os.path.join(root, n) for n in names if n.startswith(_DIR_PREFIX)]
    stale = [p for p in stale if _creator_gone(p)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def _creator_gone(path: str) -> bool:
    creator, dash, _ = os.path.basename(path)[len(_DIR_PREFIX) :].partition("-")
    pid, _, ns = creator.partition(".")
    if not (dash and pid.isdigit() and ns == str(pid_namespace())):
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
    return mine and not pid_alive(int(pid))


def ipc_endpoint(name: str) -> str:
    """An `ipc://` address under the runtime dir; ZeroMQ caps the path at 107 bytes."""
    path = os.path.join(runtime_dir(), name)
    if len(path) > 107:
        raise ValueError(f"ipc path too long ({len(path)} > 107 bytes): {path}")
    return "ipc://" + path


def remove_ipc_endpoint(endpoint: str) -> None:
    """Remove an `ipc://` endpoint's socket file (left by a process killed at once), and
    its runtime dir once empty."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint.removeprefix("ipc://")
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


def new_prefix(tag: str = "mpp") -> str:
    """A per-instance name prefix: `<tag>_<pid>_<random>`; sweeps key on the pid part."""
    if not tag.replace("-", "").isalnum():
        raise ValueError(f"prefix tag must be alphanumeric (dashes allowed): {tag!r}")
    return f"{tag}_{os.getpid()}_{secrets.token_hex(3)}"


def chain_signal(sig: int, cleanup: Callable[[], object]) -> None:
    """On `sig`, run `cleanup`, then the handler installed before (one the program set, not
    the default), else die of the same signal."""
    previous = signal.getsignal(sig)

    def handler(signum, frame):
        cleanup()
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)

    signal.signal(sig, handler)


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send this process `sig` once `parent` exits (Linux); False if it
    has exited already.

    NOTE: the signal follows the parent *thread* that started this process: a parent must
    start its children from a thread that lives as long as it does.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return parent_alive(parent)  # the parent may have died before the prctl


def parent_alive(parent: int) -> bool:
    """True while `parent` is still this process's parent. Unlike `pid_alive`, a new
    process that got the dead parent's pid cannot fool it: an orphan's parent changes."""
    return os.getppid() == parent


@functools.cache
def pid_namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid; 0 where unknown).
    Names that carry a creator's pid carry this too: in another namespace (a container
    sharing /dev/shm or /tmp) the same pid is another process."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return _kill0(pid)
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def _kill0(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
