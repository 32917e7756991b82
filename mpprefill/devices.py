"""The forward's device, resolved once from --device: what the rest of the code asks.

| --device  | kind     | tensors on | clock charges time | host link          |
|-----------|----------|------------|--------------------|--------------------|
| cpu       | cpu      | cpu        | no                 | none (copies run)  |
| cuda[:i]  | cuda     | cuda[:i]   | no (the GPU runs)  | none (copies run)  |
| emulated  | emulated | cpu        | yes: the roofline  | PCIe of the GPU    |

`ServerArgs.worker_device` is the one place that reads the flag; code below it asks a
`Device` (`device.emulated`, `device.label`, ...), never a name. It is plain data: the
emulated clock and host link are made from it by `emulation.setup`, a layer above.
"""

from __future__ import annotations

from dataclasses import dataclass

EMULATED = "emulated"  # --device's name for the emulated accelerator


@dataclass(frozen=True)
class Emulation:
    """What the emulated accelerator emulates: --emulate-model on --emulate-gpu, one GPU
    of a group of `tp_size`, in the flags' dtypes."""

    model: str
    gpu: str
    tp_size: int = 1
    launch_us: float = 0.0
    issue: str = "model"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)  # NOTE: no slots: it crosses spawn by pickle, also on Python 3.10
class Device:
    """`torch_device`: where the worker's tensors live ("cpu", "cuda", "cuda:1").
    `emulation`: set on the emulated accelerator, whose tensors live on the CPU."""

    torch_device: str
    emulation: Emulation | None = None

    @property
    def emulated(self) -> bool:
        """A clock charges the device's time (the roofline's), not the host's work."""
        return self.emulation is not None

    @property
    def kind(self) -> str:
        """ "cpu", "cuda" or "emulated"."""
        return EMULATED if self.emulated else self.torch_type

    @property
    def torch_type(self) -> str:
        """The tensors' device type: "cpu" or "cuda" (an emulated device's are the CPU's)."""
        return self.torch_device.split(":")[0]

    @property
    def on_cuda(self) -> bool:
        return self.torch_type == "cuda"

    @property
    def label(self) -> str:
        """The device as bench tables and JSON name it."""
        if self.emulation is not None:
            return f"{EMULATED} ({self.emulation.gpu}, {self.emulation.model})"
        return self.torch_device

    def group_size(self, tp_size: int) -> int:
        """Forward processes of a worker of `tp_size` ranks: one per rank, but one in all
        on the emulated device, whose clock charges one rank's time of the whole group
        (the ranks run the same host path in lockstep)."""
        return 1 if self.emulated else tp_size
