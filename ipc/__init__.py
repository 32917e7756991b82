"""ipc: shared tensors, events and one-slot mailboxes between processes.

Knows nothing of LLMs; never imports mpprefill.
"""

from ipc.bundle import SharedBundle, open_bundle
from ipc.codec import CodecError, decode, encode, message
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

__all__ = [
    "SharedBundle",
    "open_bundle",
    "Channel",
    "CodecError",
    "EventTimeout",
    "MailboxError",
    "MailboxFull",
    "MailboxTimeout",
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
