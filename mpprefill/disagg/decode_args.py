"""The decode receiver's command line: its frozen args, their flags, and the serve entry."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
from dataclasses import dataclass, field

import ipc
from mpprefill.config import ServerArgs
from mpprefill.disagg.backends import DECODE_BACKENDS


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


def _server(name: str, **kw):
    """The server's flag of that name: same default and help (the verify model's)."""
    f = ServerArgs.__dataclass_fields__[name]
    return _f(f.default, f.metadata["help"], **kw)


@dataclass(frozen=True)
class DecodeArgs:
    host: str = _f("127.0.0.1", "address the decode socket binds to")
    port: int = _f(30200, "decode socket port (0: any free port)")
    page_size: int = _f(16, "tokens per receive page")
    max_total_tokens: int = _f(16384, "receive pool capacity in tokens")
    model_path: str | None = _f(None, "model dir (its dims size the pool; --verify runs it)")
    random_seed: int = _f(0, "seed of the built-in model's weights")
    verify: bool = _f(False, "recompute each prompt's KV and compare it to what arrived")
    sliding_window: int | None = _server("sliding_window", type=int)
    swa_layers: str | None = _server("swa_layers")
    disaggregation_transfer_backend: str = _f("shm", "how KV arrives", choices=DECODE_BACKENDS)
    register_timeout: float = _f(30.0, "seconds a registration may wait for free pages")
    log_level: str = _f("info", "logging level")
    test_transfer_delay_ms: float = _f(
        0.0, "test only: hold each finished transfer's answer this long (see decode_delay.py)"
    )
    test_transfer_delay_every: int = _f(1, "test only: delay rooms whose number is a multiple")

    def __post_init__(self):
        if self.page_size < 1 or self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page of --page-size")
        if self.disaggregation_transfer_backend not in DECODE_BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend: one of {DECODE_BACKENDS}")
        if self.test_transfer_delay_ms < 0 or self.test_transfer_delay_every < 1:
            raise ValueError("--test-transfer-delay-ms must be >= 0, --...-every >= 1")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"--sliding-window must be positive, got {self.sliding_window}")

    @classmethod
    def from_namespace(cls, ns) -> DecodeArgs:
        if isinstance(ns, cls):
            return ns
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(ns, n) for n in names if getattr(ns, n, None) is not None})


def add_decode_args(ap: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(DecodeArgs):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if isinstance(f.default, bool):
            ap.add_argument(flag, action="store_true", help=help)
            continue
        kind = f.metadata.get("type") or {int: int, float: float}.get(type(f.default), str)
        ap.add_argument(flag, type=kind, default=f.default, help=help, **_choices(f))


def _choices(f: dataclasses.Field) -> dict:
    return {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}


def run_decode(args) -> int:
    """Entry of `mpprefill decode`: serve until SIGINT/SIGTERM, then clean up."""
    from mpprefill.disagg.decode import DecodeReceiver  # NOTE: lazy, decode imports us

    receiver = DecodeReceiver(DecodeArgs.from_namespace(args))
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: receiver.stop())
        ipc.install_signal_cleanup()
    try:
        receiver.serve_forever()
    finally:
        receiver.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    from mpprefill.disagg import decode  # its docstring is the --help text

    ap = argparse.ArgumentParser(prog="mpprefill-decode", description=decode.__doc__)
    add_decode_args(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_decode(args)
