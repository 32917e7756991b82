from __future__ import annotations

import pytest
import torch

from mpprefill.sampling.info import PACKED_FIELDS, TENSOR_FIELDS, SamplingBatchInfo
from mpprefill.sampling.params import SamplingParams

VOCAB = 32


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.1, seed=11),
        SamplingParams(temperature=1.2, top_k=64),
        SamplingParams(temperature=0.5, seed=2**63 - 1),
    ]


def _info() -> SamplingBatchInfo:
    return SamplingBatchInfo.from_params(_params(), VOCAB)


def _same_tensors(a: SamplingBatchInfo, b: SamplingBatchInfo) -> bool:
    return all(getattr(a, n) is getattr(b, n) for n in PACKED_FIELDS)


def test_from_params_shapes_and_values() -> None:
    info = _info()
    assert info.batch_size == 4 and not info.all_greedy
    assert info.temperatures.shape == (4, 1) and info.temperatures.dtype == torch.float32
    assert info.top_ks.tolist() == [VOCAB, 5, VOCAB, VOCAB]
    assert info.has_seed.tolist() == [False, True, False, True]
    assert info.seeds.tolist() == [0, 11, 0, 2**63 - 1]
    assert info.min_ps.tolist()[1] == torch.tensor(0.1).item()


def test_all_greedy_and_empty() -> None:
    greedy = [SamplingParams(), SamplingParams(temperature=3.0, top_k=1)]
    assert SamplingBatchInfo.from_params(greedy, VOCAB).all_greedy
    empty = SamplingBatchInfo.from_params([], VOCAB)
    assert empty.batch_size == 0 and empty.temperatures.shape == (0, 1)


def test_copy_for_forward_shares_tensors() -> None:
    info = _info()
    copy = info.copy_for_forward()
    assert copy is not info
    assert _same_tensors(copy, info) and copy.all_greedy == info.all_greedy


def test_pack_round_trip() -> None:
    info = _info()
    packed = info.to_tensors()
    assert list(packed) == list(TENSOR_FIELDS)
    back = SamplingBatchInfo.from_tensors(packed)
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(back, name), getattr(info, name))
    assert back.all_greedy == info.all_greedy


def test_pack_through_staging_buffers() -> None:
    specs = SamplingBatchInfo.tensor_specs(max_batch=8)
    slot = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
    info = _info()
    for name, t in info.to_tensors().items():
        slot[name][: info.batch_size].copy_(t)
    back = SamplingBatchInfo.from_tensors(slot, batch_size=info.batch_size)
    assert back.batch_size == 4
    for name in PACKED_FIELDS:
        assert torch.equal(getattr(back, name), getattr(info, name))
    assert not back.all_greedy


def test_from_tensors_recomputes_all_greedy() -> None:
    greedy = SamplingBatchInfo.from_params([SamplingParams()] * 3, VOCAB)
    assert SamplingBatchInfo.from_tensors(greedy.to_tensors()).all_greedy


def test_penalties_and_logprobs_rows_and_host_fields() -> None:
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3, return_logprob=True, top_logprobs_num=4),
        SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, top_logprobs_num=9),
        SamplingParams(return_logprob=True),
    ]
    prompts = [[3, 3, 5], [7, 2, 7, 9], [1, 1], None]
    info = SamplingBatchInfo.from_params(params, VOCAB, prompts)
    assert info.presence_penalties.tolist() == [0.0, 0.0, 0.5, 0.0]
    assert info.frequency_penalties.tolist() == [0.0, 0.0, -1.0, 0.0]
    assert info.repetition_penalties.tolist() == pytest.approx([1.0, 1.3, 1.0, 1.0])
    assert info.return_logprob.tolist() == [False, True, False, True]
    assert info.top_logprobs_nums.tolist() == [0, 4, 0, 0]  # row 2 did not ask for logprobs
    # only row 1 has a repetition penalty: its distinct prompt tokens, tagged with the row
    assert info.penalty_ids.tolist() == [(1 << 32) | 2, (1 << 32) | 7, (1 << 32) | 9]
    assert info.has_penalties and info.logprob_rows == (1, 3) and info.max_top_logprobs == 4
    plain = SamplingBatchInfo.from_params([SamplingParams()] * 2, VOCAB, [[1], [2]])
    assert not plain.has_penalties and plain.logprob_rows == () and plain.max_top_logprobs == 0
    assert plain.penalty_ids.numel() == 0


def test_ragged_rows_travel_through_staging_buffers() -> None:
    params = [SamplingParams(repetition_penalty=0.7), SamplingParams(return_logprob=True)]
    info = SamplingBatchInfo.from_params(params, VOCAB, [[4, 5, 4], [6]])
    specs = SamplingBatchInfo.tensor_specs(max_batch=8, max_penalty_ids=16)
    assert specs["penalty_ids"] == ((16,), torch.int64)
    slot = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
    for name, t in info.to_tensors().items():
        slot[name][: len(t)].copy_(t)
    back = SamplingBatchInfo.from_tensors(slot, info.batch_size, len(info.penalty_ids))
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(back, name), getattr(info, name)), name
    assert back.has_penalties and back.logprob_rows == (1,) and back.max_top_logprobs == 0
    plain = SamplingBatchInfo.from_tensors(slot, 1, 0)  # the first row alone, no prompt ids
    assert plain.has_penalties and plain.logprob_rows == () and plain.penalty_ids.numel() == 0
