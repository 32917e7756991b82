from __future__ import annotations

import dataclasses

import pytest
import torch

from mpprefill.model import ForwardBatch


def example() -> ForwardBatch:
    # request 0: 2 cached + 3 new; request 1: 0 cached + 1 new
    return ForwardBatch.build([[5, 6, 7], [9]], [2, 0], [[40, 41, 12, 13, 14], [3]])


def test_build_lays_out_the_ragged_batch():
    fb = example()
    assert (fb.batch_size, fb.num_tokens) == (2, 4)
    assert fb.positions.tolist() == [2, 3, 4, 0]
    assert fb.out_cache_loc.tolist() == [12, 13, 14, 3]
    assert fb.kv_indices.tolist() == [40, 41, 12, 13, 14, 3]
    assert fb.seq_lens.tolist() == [5, 1]
    assert fb.last_token_indices.tolist() == [2, 3]
    assert fb.to("cpu").input_ids.tolist() == [5, 6, 7, 9]


def replace(fb: ForwardBatch, **tensors) -> ForwardBatch:
    return dataclasses.replace(fb, **{k: torch.tensor(v) for k, v in tensors.items()})


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(positions=[2, 3, 4]), "positions length"),
        (dict(out_cache_loc=[12, 13, 14, 3, 8]), "out_cache_loc length"),
        (dict(extend_lens=[3, 2]), "sum\\(extend_lens\\)"),
        (dict(extend_lens=[4, 0]), "extend_len must be >= 1"),
        (dict(prefix_lens=[2]), "differ in length"),
        (dict(prefix_lens=[-1, 3]), "prefix_lens must be >= 0"),
        (dict(kv_indices=[40, 12, 13, 14, 3]), "kv_indices length"),
        (dict(input_ids=[5.0, 6.0, 7.0, 9.0]), "1-D int64"),
    ],
)
def test_validate_rejects_inconsistent_batches(change, match):
    with pytest.raises(ValueError, match=match):
        replace(example(), **change).validate()


def test_host_lengths_come_from_host_tensors_and_must_match_them():
    fb = example()
    assert fb.prefix_lens_cpu == tuple(fb.prefix_lens.tolist())
    assert fb.extend_lens_cpu == tuple(fb.extend_lens.tolist())
    assert fb.to("cpu").extend_lens_cpu == fb.extend_lens_cpu
    wrong = dataclasses.replace(fb, extend_lens_cpu=fb.extend_lens_cpu[::-1])
    with pytest.raises(ValueError, match="differ from the tensors"):
        wrong.validate()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(positions=[0, 1, 2, 0]), "positions"),
        (dict(kv_indices=[40, 41, 12, 13, 15, 3]), "out_cache_loc"),
    ],
)
def test_deep_validate_checks_contents(change, match):
    fb = replace(example(), **change)
    fb.validate()
    with pytest.raises(ValueError, match=match):
        fb.validate(deep=True)


def test_build_rejects_wrong_slot_counts():
    with pytest.raises(ValueError, match="prefix \\+ extend"):
        ForwardBatch.build([[5, 6]], [1], [[1, 2]])
    with pytest.raises(ValueError, match="one entry per request"):
        ForwardBatch.build([[5, 6]], [0, 0], [[1, 2]])
