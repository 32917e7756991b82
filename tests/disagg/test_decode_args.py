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
