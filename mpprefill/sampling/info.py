"""Batched sampling state: one row per request, as tensors the forward can use directly."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mpprefill.sampling.params import GREEDY_EPS, SamplingParams

# NOTE: the order is the wire order of a staging slot; append only.
_DTYPES: dict[str, torch.dtype] = {
    "temperatures": torch.float32,
    "top_ps": torch.float32,
    "top_ks": torch.int64,
    "min_ps": torch.float32,
    "seeds": torch.int64,
    "has_seed": torch.bool,
}
PACKED_FIELDS: tuple[str, ...] = tuple(_DTYPES)


def _row_shape(name: str) -> tuple[int, ...]:
    return (1,) if name == "temperatures" else ()


def greedy_rows(temperatures: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows that take the argmax (same rule as `SamplingParams.is_greedy`)."""
    return (temperatures.view(-1) < GREEDY_EPS) | (top_ks == 1)


@dataclass(slots=True, eq=False)
class SamplingBatchInfo:
    """Sampling tensors of a batch of B requests; `all_greedy`: every row is greedy."""

    temperatures: torch.Tensor  # [B, 1] float32
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, vocab size where top-k is off
    min_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64, 0 where has_seed is False
    has_seed: torch.Tensor  # [B] bool
    all_greedy: bool

    @property
    def batch_size(self) -> int:
        return self.top_ps.shape[0]

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int) -> SamplingBatchInfo:
        rows = {
            "temperatures": [[p.temperature] for p in params],
            "top_ps": [p.top_p for p in params],
            "top_ks": [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params],
            "min_ps": [p.min_p for p in params],
            "seeds": [0 if p.seed is None else p.seed for p in params],
            "has_seed": [p.seed is not None for p in params],
        }
        tensors = {name: _as_tensor(name, rows[name]) for name in PACKED_FIELDS}
        return cls(**tensors, all_greedy=all(p.is_greedy for p in params))

    def copy_for_forward(self) -> SamplingBatchInfo:
        """Shallow copy: tensors are shared, not cloned."""
        return dataclasses.replace(self)

    def to(self, device: str | torch.device) -> SamplingBatchInfo:
        moved = {name: getattr(self, name).to(device) for name in PACKED_FIELDS}
        return dataclasses.replace(self, **moved)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The rows as tensors in `PACKED_FIELDS` order, each with leading dim B."""
        return {name: getattr(self, name) for name in PACKED_FIELDS}

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], batch_size: int | None = None
    ) -> SamplingBatchInfo:
        """Rebuild from `to_tensors()` output or from larger staging buffers (first B rows).

        The tensors are viewed, not copied; `all_greedy` is recomputed from the rows.
        """
        rows = {name: tensors[name][:batch_size] for name in PACKED_FIELDS}
        greedy = greedy_rows(rows["temperatures"], rows["top_ks"])
        return cls(**rows, all_greedy=bool(greedy.all()))

    @staticmethod
    def tensor_specs(max_batch: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each packed field for a staging buffer of `max_batch` rows."""
        return {name: ((max_batch, *_row_shape(name)), _DTYPES[name]) for name in PACKED_FIELDS}


def _as_tensor(name: str, rows: list) -> torch.Tensor:
    out = torch.tensor(rows, dtype=_DTYPES[name])
    return out.reshape(len(rows), *_row_shape(name))
