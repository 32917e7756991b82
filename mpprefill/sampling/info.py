"""Batched sampling state: one row per request, as tensors the forward can use directly."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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
    "presence_penalties": torch.float32,
    "frequency_penalties": torch.float32,
    "repetition_penalties": torch.float32,
    "return_logprob": torch.bool,
    "top_logprobs_nums": torch.int64,
}
PACKED_FIELDS: tuple[str, ...] = tuple(_DTYPES)  # one row per request
# Of any length: (row << 32) | token id, for each distinct prompt token of each row whose
# repetition penalty applies (`penalty.prompt_mask` turns them into a [B, V] mask).
RAGGED_FIELDS: tuple[str, ...] = ("penalty_ids",)
TENSOR_FIELDS: tuple[str, ...] = PACKED_FIELDS + RAGGED_FIELDS
ROW_SHIFT = 32


def _row_shape(name: str) -> tuple[int, ...]:
    return (1,) if name == "temperatures" else ()


def greedy_rows(temperatures: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows that take the argmax (same rule as `SamplingParams.is_greedy`)."""
    return (temperatures.view(-1) < GREEDY_EPS) | (top_ks == 1)


@dataclass(slots=True, eq=False)
class SamplingBatchInfo:
    """Sampling tensors of a batch of B requests, and what the host decides from them:
    `all_greedy` (every row is greedy), `has_penalties` (some row's penalty changes its
    logits), `logprob_rows` (the rows that want logprobs) and `max_top_logprobs` (the most
    alternatives one of them wants)."""

    temperatures: torch.Tensor  # [B, 1] float32
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, vocab size where top-k is off
    min_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64, 0 where has_seed is False
    has_seed: torch.Tensor  # [B] bool
    presence_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32, 1 where off
    return_logprob: torch.Tensor  # [B] bool
    top_logprobs_nums: torch.Tensor  # [B] int64, 0 where return_logprob is False
    penalty_ids: torch.Tensor  # [N] int64, see RAGGED_FIELDS
    all_greedy: bool
    has_penalties: bool = False
    logprob_rows: tuple[int, ...] = ()
    max_top_logprobs: int = 0

    @property
    def batch_size(self) -> int:
        return self.top_ps.shape[0]

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        vocab_size: int,
        prompts: Sequence[Sequence[int] | None] | None = None,
    ) -> SamplingBatchInfo:
        """`prompts` (optional, one per row, None to skip a row): the token ids a row's
        repetition penalty covers on the prefill (its prompt, where this batch samples
        its first token); rows without a repetition penalty ship none."""
        rows = {
            "temperatures": [[p.temperature] for p in params],
            "top_ps": [p.top_p for p in params],
            "top_ks": [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params],
            "min_ps": [p.min_p for p in params],
            "seeds": [0 if p.seed is None else p.seed for p in params],
            "has_seed": [p.seed is not None for p in params],
            "presence_penalties": [p.presence_penalty for p in params],
            "frequency_penalties": [p.frequency_penalty for p in params],
            "repetition_penalties": [p.repetition_penalty for p in params],
            "return_logprob": [p.return_logprob for p in params],
            "top_logprobs_nums": [p.num_top_logprobs for p in params],
        }
        tensors = {name: _as_tensor(name, rows[name]) for name in PACKED_FIELDS}
        tensors["penalty_ids"] = _penalty_ids(params, prompts)
        asking = [p for p in params if p.return_logprob]
        return cls(
            **tensors,
            all_greedy=all(p.is_greedy for p in params),
            has_penalties=any(p.has_penalties for p in params),
            logprob_rows=tuple(i for i, p in enumerate(params) if p.return_logprob),
            max_top_logprobs=max((p.num_top_logprobs for p in asking), default=0),
        )

    def copy_for_forward(self) -> SamplingBatchInfo:
        """Shallow copy: tensors are shared, not cloned."""
        return dataclasses.replace(self)

    def to(self, device: str | torch.device, non_blocking: bool = False) -> SamplingBatchInfo:
        moved = {n: getattr(self, n).to(device, non_blocking=non_blocking) for n in TENSOR_FIELDS}
        return dataclasses.replace(self, **moved)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The rows as tensors in `TENSOR_FIELDS` order: PACKED_FIELDS with leading dim B,
        then the ragged ones."""
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor],
        batch_size: int | None = None,
        num_penalty_ids: int | None = None,
    ) -> SamplingBatchInfo:
        """Rebuild from `to_tensors()` output or from larger staging buffers (first B rows,
        first `num_penalty_ids` ragged entries).

        The tensors are viewed, not copied; the host fields are recomputed from the rows
        (so a slot's rows must be readable from the host).
        """
        rows = {name: tensors[name][:batch_size] for name in PACKED_FIELDS}
        rows["penalty_ids"] = tensors["penalty_ids"][:num_penalty_ids]
        greedy = greedy_rows(rows["temperatures"], rows["top_ks"])
        penalised = (
            (rows["presence_penalties"] != 0)
            | (rows["frequency_penalties"] != 0)
            | (rows["repetition_penalties"] != 1)
        )
        asking = rows["return_logprob"]
        tops = rows["top_logprobs_nums"][asking]
        return cls(
            **rows,
            all_greedy=bool(greedy.all()),
            has_penalties=bool(penalised.any()),
            logprob_rows=tuple(asking.nonzero().flatten().tolist()),
            max_top_logprobs=int(tops.max()) if len(tops) else 0,
        )

    @staticmethod
    def tensor_specs(
        max_batch: int, max_penalty_ids: int = 0
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each field for a staging buffer of `max_batch` rows and
        `max_penalty_ids` ragged entries (the prompt tokens of its rows, at most)."""
        specs = {name: ((max_batch, *_row_shape(name)), _DTYPES[name]) for name in PACKED_FIELDS}
        specs["penalty_ids"] = ((max_penalty_ids,), torch.int64)
        return specs


def _as_tensor(name: str, rows: list) -> torch.Tensor:
    out = torch.tensor(rows, dtype=_DTYPES[name])
    return out.reshape(len(rows), *_row_shape(name))


def _penalty_ids(
    params: list[SamplingParams], prompts: Sequence[Sequence[int] | None] | None
) -> torch.Tensor:
    ids: list[int] = []
    for row, (p, prompt) in enumerate(zip(params, prompts or [None] * len(params), strict=True)):
        if prompt is not None and p.repetition_penalty != 1.0:
            ids.extend((row << ROW_SHIFT) | t for t in sorted(set(prompt)))
    return torch.tensor(ids, dtype=torch.int64)
