"""Flags from a frozen dataclass and back: types from annotations, defaults, help, choices."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.flags import add_flags, from_namespace, option


@dataclass(frozen=True)
class Toy:
    name: str = option("toy", "its name")
    size: int = option(3, "how many")
    rate: float = option(0.5, "how fast")
    loud: bool = option(False, "shout")
    limit: int | None = option(None, "upper bound (none: no bound)")
    color: str | None = option(None, "paint", choices=("red", "blue"))


def parser(cls: type = Toy, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_flags(ap, cls, skip)
    return ap


def test_no_flags_give_the_defaults():
    assert from_namespace(Toy, parser().parse_args([])) == Toy()


def test_types_come_from_the_annotations():
    argv = ["--name", "x", "--size", "7", "--rate", "2", "--loud", "--limit", "9"]
    toy = from_namespace(Toy, parser().parse_args([*argv, "--color", "red"]))
    assert toy == Toy("x", 7, 2.0, True, 9, "red")
    assert type(toy.rate) is float and type(toy.limit) is int


def test_help_and_choices_come_from_the_metadata():
    actions = {a.dest: a for a in parser()._actions}
    assert actions["size"].help == "how many" and actions["size"].option_strings == ["--size"]
    assert actions["color"].choices == ("red", "blue")
    with pytest.raises(SystemExit):
        parser().parse_args(["--color", "green"])


def test_skipped_fields_have_no_flag_and_keep_their_default():
    ap = parser(skip=("size",))
    with pytest.raises(SystemExit):
        ap.parse_args(["--size", "4"])
    assert from_namespace(Toy, ap.parse_args([])).size == 3


def test_from_namespace_ignores_other_flags_and_applies_overrides():
    ns = SimpleNamespace(size=5, limit=None, command="serve")
    assert from_namespace(Toy, ns) == Toy(size=5)
    assert from_namespace(Toy, ns, size=6, color="blue") == Toy(size=6, color="blue")


def test_an_annotation_without_a_flag_type_is_refused():
    @dataclass(frozen=True)
    class Bad:
        sizes: list[int] | None = option(None, "several")

    with pytest.raises(TypeError, match="sizes"):
        parser(Bad)


@pytest.mark.parametrize("cls", [ServerArgs, DecodeArgs])
def test_the_projects_args_round_trip(cls):
    assert from_namespace(cls, parser(cls).parse_args([])) == cls()


def test_server_args_flags():
    argv = ["--forward-mode", "proc", "--page-size", "32", "--check-invariants"]
    ns = parser(ServerArgs).parse_args([*argv, "--sliding-window", "64"])
    args = from_namespace(ServerArgs, ns, trace_dir="t")
    assert (args.forward_mode, args.page_size, args.check_invariants) == ("proc", 32, True)
    assert (args.sliding_window, args.trace_dir) == (64, "t")
    with pytest.raises(SystemExit):
        parser(ServerArgs).parse_args(["--forward-mode", "sideways"])


def test_decode_args_flags():
    argv = ["--port", "0", "--verify", "--sliding-window", "8"]
    args = from_namespace(DecodeArgs, parser(DecodeArgs).parse_args(argv))
    assert (args.port, args.verify, args.sliding_window) == (0, True, 8)
    with pytest.raises(SystemExit):  # a test hook, injected by tests/slow_decode.py
        parser(DecodeArgs).parse_args(["--test-transfer-delay-ms", "5"])


def test_the_slow_decode_launcher_injects_its_delay(monkeypatch):
    from mpprefill.decode.delay import TransferDelay
    from tests import slow_decode

    got = {}

    def run(ns, prog, delay):
        got.update(args=from_namespace(DecodeArgs, ns), delay=delay)
        return 0

    monkeypatch.setattr(slow_decode, "run_decode", run)
    argv = ["--delay-ms", "5", "--delay-every", "2", "--page-size", "32", "--log-level", "warning"]
    assert slow_decode.main(argv) == 0
    assert got["delay"] == TransferDelay(5.0, 2) and got["args"].page_size == 32
    assert (got["delay"].seconds(4), got["delay"].seconds(3)) == (0.005, 0.0)
    with pytest.raises(ValueError, match="every >= 1"):
        TransferDelay(5.0, 0)
