"""--dtype and --kv-cache-dtype: resolution against the checkpoint, the loader's casts, the
pool's own dtype. (The bfloat16 oracle against transformers is in test_hf_oracle.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpprefill.config import ServerArgs
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig, config_from_hf, load_model
from mpprefill.model.config import Dtypes, resolve_dtypes
from mpprefill.model.export import hf_config, save_random_model
from mpprefill.model.loader import read_config, source_config
from mpprefill.worker.build import kv_dtype, worker_model_config

SMALL = dataclasses.replace(
    ModelConfig.tiny(), vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2
)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A random checkpoint saved in bfloat16 (config.json says so)."""
    config = dataclasses.replace(SMALL, dtype="bfloat16")
    return save_random_model(config, str(tmp_path_factory.mktemp("bf16")), seed=3)


def test_auto_takes_the_checkpoints_dtype_and_kv_auto_the_models():
    assert resolve_dtypes("auto", "auto", "bfloat16") == Dtypes("bfloat16", "bfloat16")
    assert resolve_dtypes("auto", "auto", "float32") == Dtypes("float32", "float32")
    assert resolve_dtypes("float16", "auto", "bfloat16") == Dtypes("float16", "float16")
    assert resolve_dtypes("auto", "float32", "bfloat16") == Dtypes("bfloat16", "float32")
    assert resolve_dtypes("float32", "bfloat16", "bfloat16").kv_torch == torch.bfloat16
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        resolve_dtypes("auto", "float64", "float32")


def test_server_args_resolve_against_the_checkpoint(bf16_dir):
    def dtypes(**kw) -> tuple[str, torch.dtype]:
        args = ServerArgs(**kw)
        cfg = args.worker_config()
        config = worker_model_config(cfg)
        return config.dtype, kv_dtype(cfg, config)

    assert read_config(bf16_dir).dtype == "bfloat16"
    assert dtypes(model_path=bf16_dir) == ("bfloat16", torch.bfloat16)
    assert dtypes() == ("float32", torch.float32)  # the built-in model
    assert dtypes(dtype="bfloat16") == ("bfloat16", torch.bfloat16)
    assert dtypes(model_path=bf16_dir, dtype="float32") == ("float32", torch.float32)
    assert dtypes(model_path=bf16_dir, kv_cache_dtype="float32") == ("bfloat16", torch.float32)
    assert dtypes(kv_cache_dtype="float16") == ("float32", torch.float16)
    with pytest.raises(ValueError, match="--dtype"):
        ServerArgs(dtype="float64")


def test_config_json_names_its_dtype_either_way():
    base = {**hf_config(SMALL), "torch_dtype": None}
    assert config_from_hf({**base, "torch_dtype": "bfloat16"}).dtype == "bfloat16"
    assert config_from_hf({**base, "dtype": "float16"}).dtype == "float16"  # transformers 5
    assert config_from_hf(base).dtype == "float32"  # none named
    with pytest.raises(ValueError, match="torch_dtype 'float64'"):
        config_from_hf({**base, "torch_dtype": "float64"})


def test_a_bfloat16_checkpoint_loads_in_any_dtype(bf16_dir):
    native = load_model(bf16_dir)
    up = load_model(bf16_dir, dtype="float32")
    assert native.config.dtype == "bfloat16" and up.config.dtype == "float32"
    assert {p.dtype for p in native.parameters()} == {torch.bfloat16}
    for (name, a), (_, b) in zip(native.named_parameters(), up.named_parameters(), strict=True):
        assert b.dtype == torch.float32 and torch.equal(a.float(), b), name  # exact upcast
    assert (
        source_config(ServerArgs(model_path=bf16_dir, dtype="float32").model_source()).dtype
        == "float32"
    )


def test_the_kv_pool_takes_its_own_dtype():
    kv = KVCache.for_model(SMALL, 32, dtype=torch.bfloat16)
    assert kv.dtype == torch.bfloat16 and SMALL.dtype == "float32"
    assert KVCache.for_model(SMALL, 32).dtype == torch.float32  # default: the model's
    with pytest.raises(ValueError, match="expected"):  # a buffer of another dtype is refused
        KVCache.for_model(SMALL, 32, buffer=kv.storage, dtype=torch.float32)
