"""The decode receiver's pool follows an emulated prefill's stand-in model."""

from __future__ import annotations

import pytest

from mpprefill.disagg.decode.args import DecodeArgs
from mpprefill.disagg.decode.receiver import pool_model_config
from mpprefill.model import ModelConfig
from mpprefill.worker.emulated import host_config


def test_pool_model_follows_the_emulated_prefill():
    assert pool_model_config(DecodeArgs()) == ModelConfig.tiny()
    emulated = pool_model_config(DecodeArgs(emulate_model="Llama-3.1-8B"))
    assert emulated == host_config(ModelConfig.tiny(), "Llama-3.1-8B")
    assert emulated.num_hidden_layers == 32
    with pytest.raises(ValueError, match="verify"):
        DecodeArgs(emulate_model="Llama-3.1-8B", verify=True)


def test_eos_ids_come_from_both_config_files(tmp_path):
    from mpprefill.disagg.decode.server import eos_token_ids

    assert eos_token_ids(None) == ()  # the built-in model has none
    assert eos_token_ids(str(tmp_path)) == ()
    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    assert eos_token_ids(str(tmp_path)) == (2,)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 2, true, null]}')
    assert eos_token_ids(str(tmp_path)) == (2, 7)


def test_decode_ports_are_checked():
    assert (DecodeArgs().port, DecodeArgs().zmq_port) == (0, 30201)  # no HTTP front
    with pytest.raises(ValueError, match="--zmq-port"):
        DecodeArgs(zmq_port=70000)
