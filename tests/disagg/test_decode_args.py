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

    from mpprefill.disagg import wire
    from mpprefill.disagg.decode.server import DecodeServer
    from mpprefill.server import protocol
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
