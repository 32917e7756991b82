"""`python -m mpprefill.launch_server`: an SGLang launch line becomes `mpprefill serve` or
`mpprefill decode` with the same flags (the translation only: no server starts)."""

from __future__ import annotations

import pytest

from mpprefill.cli import build_parser
from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.flags import from_namespace
from mpprefill.launch_server import translate

PREFILL = [
    "--model-path",
    "/models/m",
    "--disaggregation-mode",
    "prefill",
    "--port",
    "30000",
    "--disaggregation-bootstrap-port",
    "9000",
    "--page-size",
    "32",
]


def test_prefill_is_serve_with_the_other_flags_in_order():
    expected = ["serve", "--model-path", "/models/m", "--port", "30000"]
    expected += ["--disaggregation-bootstrap-port", "9000", "--page-size", "32"]
    assert translate(PREFILL) == expected


def test_decode_is_decode_and_the_equals_form_is_read():
    argv = ["--disaggregation-mode=decode", "--port", "30001", "--max-total-tokens", "4096"]
    assert translate(argv) == ["decode", "--port", "30001", "--max-total-tokens", "4096"]


def test_the_translated_lines_parse_as_the_servers_args():
    ns = build_parser().parse_args(translate(PREFILL))
    args = from_namespace(ServerArgs, ns)
    assert (args.model_path, args.port, args.page_size) == ("/models/m", 30000, 32)
    assert args.bootstrap_listen.port == 9000 and args.disaggregation_mode == "prefill"
    argv = ["--disaggregation-mode", "decode", "--port", "30001", "--page-size", "32"]
    decode = from_namespace(DecodeArgs, build_parser().parse_args(translate(argv)))
    assert (decode.port, decode.page_size, decode.receiver_listen.port) == (30001, 32, 30201)


@pytest.mark.parametrize("argv", [["--port", "30000"], ["--disaggregation-mode", "null"]])
def test_no_role_or_null_is_a_usage_error_saying_why(argv, capsys):
    with pytest.raises(SystemExit) as e:
        translate(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "serves only disaggregated roles" in err and "prefill" in err and "decode" in err


def test_an_unknown_role_or_flag_gets_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        translate(["--disaggregation-mode", "encode"])
    assert e.value.code == 2 and "invalid choice: 'encode'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(translate([*PREFILL, "--no-such-flag"]))
    assert e.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
