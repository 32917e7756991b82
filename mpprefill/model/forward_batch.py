"""ForwardBatch: the tensors that describe one ragged prefill batch to the model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import torch

# NOTE: B requests, T = sum(extend_lens) new tokens; request r has prefix p_r and extend e_r.
#
#   tensor                                  length           contents
#   input_ids / positions / out_cache_loc   T                req 0's e_0 | req 1's e_1 | ...
#   prefix_lens / extend_lens               B
#   kv_indices                              sum(p_r + e_r)   (p_0 | e_0) | (p_1 | e_1) | ...
#
# The new-token part of request r's kv_indices range equals its slice of out_cache_loc.
#
# Models with sliding-window layers may also carry swa_out_cache_loc [T] and swa_kv_indices
# [sum(p_r + e_r)]: the same positions in the SWA pool's slots (-1 where a key has left the
# window and its SWA page is gone). Empty (the default) means the SWA slots are the full ones.
#
# prefix_lens_cpu / extend_lens_cpu are host copies of prefix_lens / extend_lens (SGLang's
# extend_seq_lens_cpu). The forward's host code (attention plans, shapes, the rope table's
# length) reads only these, never a device tensor: on a GPU such a read waits for the
# device, and batch N + 1 could not be issued while batch N runs.


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    kv_indices: torch.Tensor
    swa_out_cache_loc: torch.Tensor = field(default_factory=lambda: _long([]))
    swa_kv_indices: torch.Tensor = field(default_factory=lambda: _long([]))
    prefix_lens_cpu: tuple[int, ...] | None = None
    extend_lens_cpu: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Host lengths not given are read from the tensors, which must then be on the
        host: device-side lengths need their host copies passed in."""
        if self.prefix_lens_cpu is None or self.extend_lens_cpu is None:
            _check(
                self.prefix_lens.device.type == "cpu" and self.extend_lens.device.type == "cpu",
                "lengths on a device need prefix_lens_cpu and extend_lens_cpu",
            )
            self.prefix_lens_cpu = tuple(self.prefix_lens.tolist())
            self.extend_lens_cpu = tuple(self.extend_lens.tolist())

    @property
    def has_swa_slots(self) -> bool:
        return len(self.swa_out_cache_loc) > 0

    def swa_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out_cache_loc, kv_indices) of the sliding-window layers' pool."""
        if self.has_swa_slots:
            return self.swa_out_cache_loc, self.swa_kv_indices
        return self.out_cache_loc, self.kv_indices

    @property
    def batch_size(self) -> int:
        return self.extend_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Row of each request's last new token in the [T] token dimension."""
        return torch.cumsum(self.extend_lens, 0) - 1

    @classmethod
    def build(
        cls,
        input_ids: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        kv_slots: Sequence[Sequence[int]],
    ) -> ForwardBatch:
        """From per-request new token ids, prefix lengths and whole-sequence KV slots."""
        same = len(input_ids) == len(prefix_lens) == len(kv_slots)
        _check(same, "input_ids, prefix_lens and kv_slots need one entry per request")
        for ids, p, slots in zip(input_ids, prefix_lens, kv_slots, strict=True):
            _check(len(slots) == p + len(ids), "each kv_slots row needs prefix + extend slots")
        new_slots = [list(s)[p:] for s, p in zip(kv_slots, prefix_lens, strict=True)]
        positions = [
            list(range(p, p + len(ids))) for ids, p in zip(input_ids, prefix_lens, strict=True)
        ]
        fb = cls(
            input_ids=_flat(input_ids),
            positions=_flat(positions),
            out_cache_loc=_flat(new_slots),
            prefix_lens=_long(prefix_lens),
            extend_lens=_long([len(ids) for ids in input_ids]),
            kv_indices=_flat(kv_slots),
        )
        fb.validate(deep=True)
        return fb

    @property
    def max_seq_len(self) -> int:
        """The longest prefix + extend, from the host lengths."""
        return max(map(sum, zip(self.prefix_lens_cpu, self.extend_lens_cpu)), default=0)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ForwardBatch:
        return self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ForwardBatch:
        """The batch with `fn` applied to each tensor; the host lengths are kept."""
        return ForwardBatch(
            **{n: fn(getattr(self, n)) for n in TENSORS},
            prefix_lens_cpu=self.prefix_lens_cpu,
            extend_lens_cpu=self.extend_lens_cpu,
        )

    def validate(self, deep: bool = False) -> None:
        """Check dtypes and lengths; deep also checks contents (positions, slots)."""
        for name in TENSORS:
            t = getattr(self, name)
            _check(t.dim() == 1 and t.dtype == torch.int64, f"{name} must be 1-D int64")
        b, t = self.batch_size, self.num_tokens
        _check(self.prefix_lens.shape[0] == b, "prefix_lens and extend_lens differ in length")
        for name in ("positions", "out_cache_loc"):
            _check(getattr(self, name).shape[0] == t, f"{name} length != len(input_ids) ({t})")
        if self.has_swa_slots or len(self.swa_kv_indices):
            _check(self.swa_out_cache_loc.shape[0] == t, "swa_out_cache_loc length != T")
            _check(
                self.swa_kv_indices.shape[0] == self.kv_indices.shape[0],
                "swa_kv_indices length != kv_indices length",
            )
        _check(b == 0 or int(self.extend_lens.min()) >= 1, "every extend_len must be >= 1")
        _check(b == 0 or int(self.prefix_lens.min()) >= 0, "prefix_lens must be >= 0")
        _check(int(self.extend_lens.sum()) == t, "sum(extend_lens) != number of new tokens")
        _check(
            self.kv_indices.shape[0] == int(self.seq_lens.sum()),
            "kv_indices length != sum(prefix_lens + extend_lens)",
        )
        host = (list(self.prefix_lens_cpu), list(self.extend_lens_cpu))
        same = host == (self.prefix_lens.tolist(), self.extend_lens.tolist())
        _check(same, "prefix_lens_cpu / extend_lens_cpu differ from the tensors")
        if deep:
            self._validate_contents()

    def check_window_slots(self, window: int) -> None:
        """Raise unless every key inside a sliding window of `window` has an SWA slot
        (host tensors; the scheduler's check of the batches it builds)."""
        if not self.has_swa_slots:
            return
        first = [max(0, p - window + 1) for p in self.prefix_lens_cpu]
        seq = [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu)]
        start = 0
        for f, n in zip(first, seq):
            if bool((self.swa_kv_indices[start + f : start + n] < 0).any()):
                raise RuntimeError("a key inside the sliding window has no SWA slot")
            start += n

    def _validate_contents(self) -> None:
        starts = torch.repeat_interleave(self.prefix_lens, self.extend_lens)
        token_offsets = torch.arange(self.num_tokens, device=self.input_ids.device)
        token_offsets -= torch.repeat_interleave(
            torch.cumsum(self.extend_lens, 0) - self.extend_lens, self.extend_lens
        )
        _check(torch.equal(self.positions, starts + token_offsets), "positions != prefix + i")
        seq_ends = torch.cumsum(self.seq_lens, 0)
        new_rows = torch.repeat_interleave(seq_ends - self.extend_lens, self.extend_lens)
        _check(
            torch.equal(self.kv_indices[new_rows + token_offsets], self.out_cache_loc),
            "kv_indices new-token part != out_cache_loc",
        )


TENSORS = tuple(f.name for f in fields(ForwardBatch) if not f.name.endswith("_cpu"))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"ForwardBatch: {message}")


def _long(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _flat(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    return _long([v for row in rows for v in row])
