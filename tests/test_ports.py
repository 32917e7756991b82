"""The port rule: auxiliary ports derive from --port unless given, the old defaults hold at
the default --port, and a port that cannot be had is one line naming its flag."""

from __future__ import annotations

import socket

import pytest

from mpprefill import ports
from mpprefill.bench.procs import free_base_port, free_port
from mpprefill.cli import build_parser
from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.flags import from_namespace
from mpprefill.ports import Listen

SHM = {"disaggregation_transfer_backend": "shm"}


def test_serve_keeps_the_old_defaults_at_the_default_port():
    for args in (ServerArgs(**SHM), ServerArgs(port=30000, **SHM)):
        assert args.zmq_listen == Listen("--zmq-port", 30100, 30000)
        assert args.bootstrap_listen == Listen("--disaggregation-bootstrap-port", 8998, 30000)
        assert args.http_listen == Listen("--port", 30000)


def test_serve_derives_its_ports_from_port_unless_given():
    args = ServerArgs(port=31000, **SHM)
    derived = [(x.port, x.base) for x in args.listens]
    assert derived == [(31000, None), (31100, 31000), (9998, 31000)]
    given = ServerArgs(port=31000, zmq_port=40000, disaggregation_bootstrap_port=0, **SHM)
    assert given.listens[1:] == [
        Listen("--zmq-port", 40000),
        Listen("--disaggregation-bootstrap-port", 0),
    ]
    # the fake backend, or a fixed --decode-address, serves no bootstrap endpoint
    fake = ServerArgs(port=31000, disable_http_front=True)
    assert fake.listens == [Listen("--zmq-port", 31100, 31000)]
    assert ServerArgs(decode_address="127.0.0.1:1", **SHM).listens[-1].flag == "--zmq-port"


def test_flags_left_out_derive_and_flags_given_stay():
    parse = build_parser().parse_args
    args = from_namespace(ServerArgs, parse(["serve", "--port", "31000"]))
    assert args.zmq_listen.port == 31100
    args = from_namespace(ServerArgs, parse(["serve", "--port", "31000", "--zmq-port", "30100"]))
    assert args.zmq_listen == Listen("--zmq-port", 30100)
    ns = parse(["decode", "--port", "31000", "--receiver-port", "0"])
    decode = from_namespace(DecodeArgs, ns)
    assert (decode.zmq_listen.port, decode.receiver_listen.port) == (31100, 0)


def test_decode_derives_its_ports_only_with_a_front():
    bare = DecodeArgs()
    assert (bare.zmq_listen, bare.receiver_listen) == (
        Listen("--zmq-port", 30201),
        Listen("--receiver-port", 30200),
    )
    assert bare.http_listen is None and len(bare.listens) == 2
    fronted = DecodeArgs(port=31000)
    assert fronted.zmq_listen == Listen("--zmq-port", 31100, 31000)
    assert fronted.receiver_listen == Listen("--receiver-port", 31200, 31000)
    assert DecodeArgs(port=31000, zmq_port=0).zmq_listen == Listen("--zmq-port", 0)


def test_servers_within_100_ports_of_each_other_share_none():
    taken = []
    for p in range(30000, 30050):
        taken += [x.port for x in ServerArgs(port=p, **SHM).listens]
    for p in range(30050, 30100):
        taken += [x.port for x in DecodeArgs(port=p).listens]
    assert len(taken) == len(set(taken))


def test_a_derived_port_out_of_range_names_its_flag():
    with pytest.raises(ValueError, match=r"--disaggregation-bootstrap-port -13002 \(derived"):
        ServerArgs(port=8000, **SHM)
    assert ServerArgs(port=8000).zmq_listen.port == 8100  # no bootstrap endpoint: fine
    with pytest.raises(ValueError, match=r"--zmq-port 65600 \(derived from --port 65500\)"):
        DecodeArgs(port=65500)
    with pytest.raises(ValueError, match="--receiver-port 70000 is outside 0..65535"):
        DecodeArgs(receiver_port=70000)


def _occupied(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_port_in_use_is_one_line_naming_its_flag():
    base = free_base_port((100,))
    with _occupied(base + 100):
        derived = ports.derive("--zmq-port", None, base, ports.ZMQ_OFFSET)
        with pytest.raises(ports.PortUnavailable) as e:
            ports.check_free([("127.0.0.1", Listen("--port", base)), ("127.0.0.1", derived)])
        assert e.value.line("mpprefill serve") == (
            f"mpprefill serve: --zmq-port {base + 100} is in use (derived from --port"
            f" {base}); pass another --port or --zmq-port"
        )
        with pytest.raises(ports.PortUnavailable) as e:
            ports.listen_socket("127.0.0.1", Listen("--zmq-port", base + 100))
        assert e.value.line("mpprefill decode") == (
            f"mpprefill decode: --zmq-port {base + 100} is in use; pass another --zmq-port"
        )


def test_checking_ports_holds_none_of_them():
    free, held = free_port(), free_port()
    listens = [Listen("--port", free), Listen("--zmq-port", held)]
    binds = [("127.0.0.1", listen) for listen in listens]
    with _occupied(held), pytest.raises(ports.PortUnavailable, match="--zmq-port"):
        ports.check_free(binds)
    ports.check_free(binds)
    ports.listen_socket("127.0.0.1", listens[0]).close()  # bindable again at once
