from __future__ import annotations

import dataclasses
import math

import pytest

from mpprefill.sampling.params import SamplingParams


def test_defaults_are_greedy_single_token() -> None:
    p = SamplingParams()
    assert p.is_greedy and p.max_new_tokens == 1 and p.seed is None


def test_from_dict_protocol_example() -> None:
    d = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": None}
    assert SamplingParams.from_dict(d) == SamplingParams()


def test_from_dict_accepts_ints_for_floats() -> None:
    p = SamplingParams.from_dict({"temperature": 1, "top_p": 1, "min_p": 0, "seed": 7})
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert p.seed == 7 and not p.is_greedy


def test_round_trip() -> None:
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=2**63 - 1)
    assert SamplingParams.from_dict(dataclasses.asdict(p)) == p


def test_stop_settings_round_trip_as_json_lists() -> None:
    d = {"stop_token_ids": [5, 7], "ignore_eos": True, "max_new_tokens": 9}
    p = SamplingParams.from_dict(d)
    assert p.stop_token_ids == (5, 7) and p.ignore_eos and p.max_new_tokens == 9
    assert SamplingParams.from_dict({**dataclasses.asdict(p), "stop_token_ids": [5, 7]}) == p
    assert SamplingParams.from_dict({"stop_token_ids": None}).stop_token_ids == ()


def test_missing_or_null_object_gives_defaults() -> None:
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_top_k_one_is_greedy() -> None:
    assert SamplingParams(temperature=2.0, top_k=1).is_greedy


BAD = [
    ({"temprature": 1.0}, "temprature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "1.0"}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 5.0}, "top_k"),
    ({"top_k": False}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"min_p": -math.inf}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"temperature": 10**400}, "temperature"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": 2.0001}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"frequency_penalty": None}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": [1.1]}, "repetition_penalty"),
    ({"return_logprob": 1}, "return_logprob"),
    ({"return_logprob": "true"}, "return_logprob"),
    ({"return_logprob": None}, "return_logprob"),
    ({"top_logprobs_num": -1}, "top_logprobs_num"),
    ({"top_logprobs_num": 21}, "top_logprobs_num"),
    ({"top_logprobs_num": 2.0}, "top_logprobs_num"),
    ({"top_logprobs_num": True}, "top_logprobs_num"),
]


@pytest.mark.parametrize(("d", "field"), BAD)
def test_from_dict_rejects(d: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(d)


@pytest.mark.parametrize("d", [[], "x", 3, [("temperature", 1.0)]])
def test_from_dict_rejects_non_object(d: object) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict(d)


def test_constructor_validates_too() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_new_field_bounds_are_accepted() -> None:
    for value in (-2, -2.0, 0, 2.0):
        assert SamplingParams(presence_penalty=value).presence_penalty == float(value)
        assert SamplingParams(frequency_penalty=value).frequency_penalty == float(value)
    assert SamplingParams(repetition_penalty=2).repetition_penalty == 2.0
    assert SamplingParams(repetition_penalty=1e-3).has_penalties
    assert SamplingParams(top_logprobs_num=20, return_logprob=True).num_top_logprobs == 20


def test_penalties_and_logprobs_round_trip_and_defaults() -> None:
    d = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.3,
        "return_logprob": True,
        "top_logprobs_num": 3,
    }
    p = SamplingParams.from_dict(d)
    assert isinstance(p.frequency_penalty, float) and p.frequency_penalty == -1.0
    assert p.has_penalties and p.num_top_logprobs == 3
    assert SamplingParams.from_dict(dataclasses.asdict(p)) == p
    plain = SamplingParams()
    assert not plain.has_penalties and not plain.return_logprob and plain.num_top_logprobs == 0
    # top_logprobs_num counts only with return_logprob
    assert SamplingParams(top_logprobs_num=4).num_top_logprobs == 0
