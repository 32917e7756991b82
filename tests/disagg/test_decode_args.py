"""The decode receiver's pool follows an emulated prefill's stand-in model and the
prefill's dtypes."""

from __future__ import annotations

import pytest
import torch

from mpprefill.bench.runner import BenchConfig
from mpprefill.cli import build_parser
from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.receiver import pool_dtypes, pool_model_config
from mpprefill.emulation.device import host_config
from mpprefill.model import ModelConfig
from mpprefill.model.config import Dtypes
from mpprefill.worker.build import kv_dtype, worker_model_config


def test_pool_model_follows_the_emulated_prefill():
    assert pool_model_config(DecodeArgs()) == ModelConfig.tiny()
    emulated = pool_model_config(DecodeArgs(emulate_model="Llama-3.1-8B"))
    assert emulated == host_config(ModelConfig.tiny(), "Llama-3.1-8B")
    assert emulated.num_hidden_layers == 32
    with pytest.raises(ValueError, match="verify"):
        DecodeArgs(emulate_model="Llama-3.1-8B", verify=True)


@pytest.mark.parametrize(
    "kw",
    [{}, {"dtype": "bfloat16"}, {"kv_cache_dtype": "float16"}, {"emulate_model": "Llama-3.1-8B"}],
)
def test_the_decode_pool_takes_the_prefills_dtype_from_the_same_flags(kw):
    args = DecodeArgs(**kw)
    dtypes = pool_dtypes(args, pool_model_config(args))
    prefill_kw = {k: v for k, v in kw.items() if k != "emulate_model"}
    if "emulate_model" in kw:
        prefill_kw.update(device="emulated", emulate_model=kw["emulate_model"])
    prefill = ServerArgs(**prefill_kw)
    worker = prefill.worker_config()
    assert dtypes.kv_torch == kv_dtype(worker, worker_model_config(worker))
    assert pool_model_config(args).dtype == worker_model_config(worker).dtype == dtypes.model


def test_decode_dtype_flags():
    assert pool_dtypes(DecodeArgs(), ModelConfig.tiny()) == Dtypes("float32", "float32")
    args = build_parser().parse_args(["decode", "--dtype", "bfloat16", "--kv-cache-dtype", "auto"])
    assert (args.dtype, args.kv_cache_dtype) == ("bfloat16", "auto")
    with pytest.raises(ValueError, match="--dtype"):
        DecodeArgs(dtype="float64")
    for command in ("bench", "profile"):
        args = build_parser().parse_args([command, "--dtype", "float16"])
        assert args.dtype == "float16" and args.kv_cache_dtype == "auto"


def test_the_bench_passes_the_dtypes_to_its_prefill_and_decode_servers():
    cfg = BenchConfig(ServerArgs(dtype="bfloat16", kv_cache_dtype="float32"), ["normal"])
    for flags in (cfg.server_flags("normal", None), cfg.decode_flags()):
        assert flags[flags.index("--dtype") + 1] == "bfloat16"
        assert flags[flags.index("--kv-cache-dtype") + 1] == "float32"
    worker = cfg.server.worker_config()
    assert kv_dtype(worker, worker_model_config(worker)) == torch.float32


def test_eos_ids_come_from_both_config_files(tmp_path):
    from mpprefill.decode.server import eos_token_ids

    assert eos_token_ids(None) == ()  # the built-in model has none
    assert eos_token_ids(str(tmp_path)) == ()
    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    assert eos_token_ids(str(tmp_path)) == (2,)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 2, true, null]}')
    assert eos_token_ids(str(tmp_path)) == (2, 7)


def test_decode_ports_are_checked():
    assert (DecodeArgs().port, DecodeArgs().zmq_listen.port) == (0, 30201)  # no HTTP front
    with pytest.raises(ValueError, match="--zmq-port"):
        DecodeArgs(zmq_port=70000)


def test_the_advertised_host_defaults_to_the_bound_one_or_this_machine():
    import socket

    assert DecodeArgs().advertised_host == "127.0.0.1"
    assert DecodeArgs(host="10.0.0.5").advertised_host == "10.0.0.5"
    machine = socket.gethostbyname(socket.gethostname())
    assert DecodeArgs(host="0.0.0.0").advertised_host == machine
    pinned = DecodeArgs(host="0.0.0.0", advertise_host="decode-7.cluster")
    assert pinned.advertised_host == "decode-7.cluster"
    assert DecodeArgs(advertise_host="[fd00::7]").advertised_host == "[fd00::7]"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("0.0.0.0", "wildcard"),
        ("::", "wildcard"),
        ("*", "wildcard"),
        ("decode-7:30200", "without a port"),
        ("[fd00::7]:30200", "without a port"),
        ("fd00::7", "brackets"),
        ("bad host", "not a host"),
    ],
)
def test_a_wildcard_or_a_port_in_advertise_host_is_refused(value, why):
    with pytest.raises(ValueError, match=why):
        DecodeArgs(advertise_host=value)


@pytest.mark.timeout(60)
def test_rooms_are_registered_with_the_advertised_host():
    """The decode server's register_room names --advertise-host and its receiver's port."""
    import zmq

    from mpprefill import protocol
    from mpprefill.decode.server import DecodeServer
    from mpprefill.disagg import wire
    from mpprefill.server.client import Client

    args = DecodeArgs(
        receiver_port=0, zmq_port=0, max_total_tokens=256, advertise_host="decode-7.cluster"
    )
    srv = DecodeServer(args)
    ctx = zmq.Context()
    endpoint = ctx.socket(zmq.ROUTER)  # stands in for a prefill's bootstrap endpoint
    endpoint.setsockopt(zmq.LINGER, 0)
    port = endpoint.bind_to_random_port("tcp://127.0.0.1")
    client = Client(f"127.0.0.1:{srv.zmq_port}")
    try:
        client.send_raw(protocol.generate_frame("adv", [1, 2, 3], {}, 9, "127.0.0.1", port))
        for _ in range(200):
            srv.step()
            if endpoint.poll(10):
                break
        _, frame = endpoint.recv_multipart()
        msg = wire.decode(frame)
        assert msg == wire.RegisterRoom(9, f"decode-7.cluster:{srv.rx.port}")
    finally:
        client.close()
        endpoint.close()
        ctx.term()
        srv.close()
