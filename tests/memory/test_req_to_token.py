from __future__ import annotations

import pytest
import torch

from mpprefill.memory.req_to_token import ReqToTokenPool


def test_alloc_until_full_then_reuse():
    pool = ReqToTokenPool(3, 8)
    rows = [pool.alloc() for _ in range(3)]
    assert rows == [0, 1, 2]
    assert pool.alloc() is None and pool.available_size() == 0
    pool.free(1)
    assert pool.available_size() == 1
    assert pool.alloc() == 1
    pool.check()


def test_double_free_and_out_of_range_raise():
    pool = ReqToTokenPool(2, 8)
    idx = pool.alloc()
    pool.free(idx)
    with pytest.raises(ValueError):
        pool.free(idx)
    with pytest.raises(IndexError):
        pool.free(5)
    pool.check()


def test_write_checks_bounds_and_row():
    pool = ReqToTokenPool(2, 8)
    idx = pool.alloc()
    pool.write(idx, 2, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[idx, 2:5].tolist() == [7, 8, 9]
    with pytest.raises(IndexError):
        pool.write(idx, 6, torch.tensor([1, 2, 3]))
    with pytest.raises(IndexError):
        pool.write(1 - idx, 0, torch.tensor([1]))


def test_table_shape_and_dtype():
    pool = ReqToTokenPool(4, 16)
    assert pool.req_to_token.shape == (4, 16)
    assert pool.req_to_token.dtype == torch.int64
    with pytest.raises(ValueError):
        ReqToTokenPool(0, 16)
