"""Scheduler <-> forward-process messages. Small, fixed-size, never pickled: the mailboxes
carry them as msgpack (ipc.codec), tagged by class name."""

from __future__ import annotations

from typing import Any

from ipc import Message, TensorHandle, message


@message
class Ready(Message, tag=True):
    """Worker -> scheduler once the model and the KV pool exist."""

    pid: int
    kv: TensorHandle
    result: dict[str, TensorHandle]
    model_config: dict[str, Any]


@message
class Submit(Message, tag=True):
    """One forward: which staging slot, how much of each field is valid (the worker
    opened both slots' handles once, at start)."""

    seq: int
    slot: int
    num_tokens: int
    num_reqs: int
    num_kv: int
    delay_sample: bool
    want_logits: bool
    num_penalty_ids: int = 0  # ragged sampling entries in the slot (SamplingBatchInfo)


@message
class Sample(Message, tag=True):
    seq: int


@message
class Done(Message, tag=True):
    """The forward (or sample) is issued; its results are readable once the event
    "result_ready" reached its generation (at once on the CPU; at `end_ns` on the
    emulated accelerator)."""

    seq: int
    forward_s: float
    sampled: bool
    start_ns: int = 0  # when the device began and finished the forward (clock_ns)
    end_ns: int = 0
    device_s: float = 0.0  # the device's busy time in it
    collective_s: float = 0.0  # the part of it in collectives


@message
class Failed(Message, tag=True):
    error: str


@message
class Exit(Message, tag=True):
    reason: str = ""
