"""The emulated accelerator's parts, made from its settings (`devices.Emulation`): the
layers that need a clock or a host link ask here with their `Device`, which is plain data
(so the config and the HTTP front never load torch or the model through it)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mpprefill.emulation.device import EmulatedDevice, EmulatedHostLink
from mpprefill.emulation.shapes import EMULATED_DTYPE, ModelShape, resolve_shape
from mpprefill.layer_configs import LinkConfig
from mpprefill.model.config import resolve_dtypes

if TYPE_CHECKING:
    from mpprefill.devices import Device, Emulation


def emulated_shape(emu: Emulation) -> ModelShape:
    """--emulate-model's shape, its bytes per element those of --dtype and --kv-cache-dtype;
    `auto` is the emulated model's own dtype (EMULATED_DTYPE), not the host stand-in's."""
    dtypes = resolve_dtypes(emu.dtype, emu.kv_cache_dtype, EMULATED_DTYPE)
    model_bytes, kv_bytes = dtypes.itemsizes
    shape = resolve_shape(emu.model)
    return dataclasses.replace(shape, dtype_bytes=model_bytes, kv_dtype_bytes=kv_bytes)


def emulated_clock(emu: Emulation) -> EmulatedDevice:
    """The accelerator's clock, which the forward runner charges."""
    return EmulatedDevice(emulated_shape(emu), emu.gpu, emu.tp_size, emu.launch_us, emu.issue)


def emulated_host_link(emu: Emulation) -> EmulatedHostLink:
    """The host link the host KV tier's copies take."""
    return EmulatedHostLink(emulated_shape(emu), emu.gpu, emu.tp_size)


def clock_for(device: Device) -> EmulatedDevice | None:
    """The clock a forward runner charges its forwards to; None off the emulated device."""
    return None if device.emulation is None else emulated_clock(device.emulation)


def host_link_for(device: Device) -> EmulatedHostLink | None:
    """The host link the host KV tier's copies take; None off the emulated device."""
    return None if device.emulation is None else emulated_host_link(device.emulation)


def transfer_link_for(link: LinkConfig | None, device: Device) -> LinkConfig | None:
    """The KV transfer's emulated link; on the emulated device a token's KV on the wire is
    the emulated model's (one rank's heads of a tensor-parallel group: each GPU has a NIC
    of its own), not the host stand-in's."""
    if link is None or device.emulation is None:
        return link
    emu = device.emulation
    wire_bytes = emulated_shape(emu).shard(emu.tp_size).kv_bytes_per_token
    return dataclasses.replace(link, kv_bytes_per_token=wire_bytes)
