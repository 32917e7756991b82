"""POSIX shared-memory segments (posix_ipc + mmap), owned and unlinked by their creator."""

from __future__ import annotations

import atexit
import itertools
import logging
import mmap
import os
import signal

import posix_ipc

from ipc.runtime import chain_signal, pid_alive, pid_namespace

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_counter = itertools.count()
# NOTE: no lock guards this: every access is one dict operation (atomic under the GIL),
# and the signal handler that unlinks the owned segments may run in the middle of any
# other access on the main thread, where a non-reentrant lock would deadlock.
_owned: dict[str, int] = {}  # segment name -> owner pid


class Segment:
    """One mapped segment. The creator (`owner=True`) is the only one that unlinks it.

    NOTE: tensors viewing the mapping keep the `mmap` object alive through their
    storage; `close()` drops this object's reference instead of unmapping, so a
    live view can never dangle.
    """

    __slots__ = ("name", "size", "owner", "_mm")

    def __init__(self, name: str, size: int, owner: bool, mm: mmap.mmap):
        self.name, self.size, self.owner, self._mm = name, size, owner, mm

    @classmethod
    def create(cls, prefix: str, size: int, reserve: bool = False) -> Segment:
        """`reserve`: allocate every page now, so that a shared-memory file system too
        small for it fails here, with ENOSPC, rather than with SIGBUS at a first touch."""
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        name = f"/{prefix}.{os.getpid()}.{pid_namespace()}.{next(_counter)}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            if reserve:
                _reserve(shm.fd, size, name)
            mm = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        _owned[name] = os.getpid()
        return cls(name, size, True, mm)

    @classmethod
    def open(cls, name: str) -> Segment:
        shm = posix_ipc.SharedMemory(name)
        size = shm.size
        try:
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, size, False, mm)

    @property
    def buffer(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._mm

    def close(self) -> None:
        self._mm = None

    def unlink(self) -> None:
        if not self.owner:
            raise PermissionError(f"only the creator unlinks segment {self.name}")
        unlink_segment(self.name)


def _reserve(fd: int, size: int, name: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        free = os.statvfs(SHM_DIR)
        raise OSError(
            e.errno,
            f"cannot reserve {size:,} bytes of shared memory for {name} "
            f"({free.f_bavail * free.f_frsize:,} free in {SHM_DIR}): {e.strerror}",
        ) from None


def unlink_segment(name: str) -> bool:
    """Unlink by name; False if it was already gone."""
    _owned.pop(name, None)
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def unlink_owned() -> int:
    """Unlink every segment this process created and has not unlinked yet."""
    pid = os.getpid()
    owned = list(_owned.items())  # one copy: other threads may add or drop names meanwhile
    return sum(unlink_segment(n) for n, p in owned if p == pid)


def list_segments(prefix: str) -> list[str]:
    """Names (with leading '/') of existing segments whose name starts with `prefix`."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted("/" + e for e in entries if e.startswith(prefix))


def sweep_stale(tag: str) -> list[str]:
    """Remove this user's segments of `tag` whose creating process no longer runs.

    Names are `/<tag>_<...>.<creator pid>.<its PID namespace>.<n>`. A starting owner
    calls this for its own tag: segments survive SIGKILL, and only their creator would
    have unlinked them. /dev/shm may be shared with other users and other PID namespaces:
    their segments are left alone, and a name that cannot be removed is logged and skipped.
    """
    removed = [name for name in list_segments(tag + "_") if _is_stale(name) and _remove(name)]
    if removed:
        logger.info("removed %d stale shared segments of %s", len(removed), tag)
    return removed


def _is_stale(name: str) -> bool:
    """This user's segment, made in this PID namespace, and its creator is gone."""
    creator = name.rsplit(".", 3)[1:-1]  # [pid, PID namespace]
    if len(creator) == 1:  # a name from before namespaces were named
        creator.append(str(pid_namespace()))
    if len(creator) != 2 or not all(f.isdigit() for f in creator):
        return False
    pid, ns = map(int, creator)
    try:
        uid = os.stat(SHM_DIR + name).st_uid
    except OSError:  # gone meanwhile
        return False
    return uid == os.getuid() and ns == pid_namespace() and not pid_alive(pid)


def _remove(name: str) -> bool:
    try:
        return unlink_segment(name)
    except (posix_ipc.Error, OSError) as e:
        logger.warning("cannot remove stale shared segment %s: %s", name, e)
        return False


def remove_prefix(prefix: str) -> int:
    """Unlink all segments of one instance prefix (the owner's cleanup after a child died)."""
    return sum(unlink_segment(n) for n in list_segments(prefix))


atexit.register(unlink_owned)


def install_signal_cleanup(signals: tuple[int, ...] | None = None) -> None:
    """Unlink this process's segments on SIGTERM/SIGINT, then die of the same signal.

    A handler already installed by the program (not the default) is kept and
    chained after the unlink.
    """
    for sig in signals or (signal.SIGTERM, signal.SIGINT):
        chain_signal(sig, unlink_owned)
