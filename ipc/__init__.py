"""ipc: shared tensors, events and one-slot mailboxes between processes.

Knows nothing of LLMs; never imports mpprefill. Its names load on first use, so that a
process which only needs the runtime helpers (the HTTP front) never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipc.bundle import SharedBundle, open_bundle
    from ipc.codec import Codec, Message, MessageError, decode, encode, message
    from ipc.events import EventTimeout, ShmEvent
    from ipc.handle import TensorHandle
    from ipc.mailbox import Channel, MailboxError, MailboxFull, MailboxTimeout, PeerDied
    from ipc.runtime import (
        die_with_parent,
        ipc_endpoint,
        new_prefix,
        parent_alive,
        pid_alive,
        remove_ipc_endpoint,
        runtime_dir,
    )
    from ipc.shm import (
        install_signal_cleanup,
        list_segments,
        remove_prefix,
        sweep_stale,
        unlink_owned,
    )
    from ipc.tensor import SharedTensor, close_handle, open_handle

_HOMES = {
    "SharedBundle": "ipc.bundle",
    "open_bundle": "ipc.bundle",
    "Codec": "ipc.codec",
    "Message": "ipc.codec",
    "MessageError": "ipc.codec",
    "decode": "ipc.codec",
    "encode": "ipc.codec",
    "message": "ipc.codec",
    "EventTimeout": "ipc.events",
    "ShmEvent": "ipc.events",
    "TensorHandle": "ipc.handle",
    "Channel": "ipc.mailbox",
    "MailboxError": "ipc.mailbox",
    "MailboxFull": "ipc.mailbox",
    "MailboxTimeout": "ipc.mailbox",
    "PeerDied": "ipc.mailbox",
    "die_with_parent": "ipc.runtime",
    "ipc_endpoint": "ipc.runtime",
    "new_prefix": "ipc.runtime",
    "parent_alive": "ipc.runtime",
    "pid_alive": "ipc.runtime",
    "remove_ipc_endpoint": "ipc.runtime",
    "runtime_dir": "ipc.runtime",
    "install_signal_cleanup": "ipc.shm",
    "list_segments": "ipc.shm",
    "remove_prefix": "ipc.shm",
    "sweep_stale": "ipc.shm",
    "unlink_owned": "ipc.shm",
    "SharedTensor": "ipc.tensor",
    "close_handle": "ipc.tensor",
    "open_handle": "ipc.tensor",
}

_SUBMODULES = {"bundle", "codec", "cuda", "events", "handle", "mailbox", "runtime", "shm", "tensor"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"ipc.{name}")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ipc' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = [
    "SharedBundle",
    "open_bundle",
    "Channel",
    "Codec",
    "EventTimeout",
    "MailboxError",
    "MailboxFull",
    "MailboxTimeout",
    "Message",
    "MessageError",
    "PeerDied",
    "SharedTensor",
    "ShmEvent",
    "TensorHandle",
    "close_handle",
    "decode",
    "die_with_parent",
    "encode",
    "install_signal_cleanup",
    "ipc_endpoint",
    "list_segments",
    "message",
    "new_prefix",
    "open_handle",
    "parent_alive",
    "pid_alive",
    "remove_ipc_endpoint",
    "remove_prefix",
    "runtime_dir",
    "sweep_stale",
    "unlink_owned",
]
