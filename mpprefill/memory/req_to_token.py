"""ReqToTokenPool: one row per live request, mapping token positions to KV slots."""

from __future__ import annotations

import torch
from torch import Tensor


class ReqToTokenPool:
    """`req_to_token[i, pos]` is the KV slot of token `pos` of the request holding row `i`.

    The table is private to the scheduler (CPU); a batch's rows travel in its snapshot.
    Rows are handed out lowest index first; a freed row is the next one reused.
    """

    def __init__(self, size: int, max_context_len: int) -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"bad req_to_token shape ({size}, {max_context_len})")
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64)
        self._free: list[int] = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        idx = self._free.pop()
        self._is_free[idx] = False
        return idx

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.size:
            raise IndexError(f"req_to_token row {idx} out of range [0, {self.size})")
        if self._is_free[idx]:
            raise ValueError(f"double free of req_to_token row {idx}")
        self._is_free[idx] = True
        self._free.append(idx)

    def write(self, idx: int, start: int, slots: Tensor) -> None:
        end = start + len(slots)
        if self._is_free[idx] or not 0 <= start <= end <= self.max_context_len:
            raise IndexError(f"bad write to row {idx} [{start}, {end})")
        self.req_to_token[idx, start:end] = slots

    def check(self) -> None:
        held = self._is_free.count(False)
        assert len(self._free) + held == self.size, "req_to_token: free + held != size"
        assert len(set(self._free)) == len(self._free), "req_to_token: row freed twice"
        assert all(self._is_free[i] for i in self._free), "req_to_token: free list disagrees"

    def __repr__(self) -> str:
        return f"ReqToTokenPool(free={len(self._free)}/{self.size}, ctx={self.max_context_len})"
