"""A decode server whose transfers answer late: `mpprefill decode`'s flags, plus the test
delay (`mpprefill.decode.delay.TransferDelay`) injected at construction.

    python -m tests.slow_decode --delay-ms MS [--delay-every K] [decode flags ...]

Run from the repository root (the `tests` package must be importable)."""

from __future__ import annotations

import argparse
import logging
import sys

from mpprefill.decode.command import add_decode_args, run_decode
from mpprefill.decode.delay import TransferDelay

PROG = "python -m tests.slow_decode"


def command(ms: float, every: int = 1) -> list[str]:
    """The command line of a slow decode server (its decode flags follow)."""
    return [
        sys.executable,
        "-m",
        "tests.slow_decode",
        "--delay-ms",
        str(ms),
        "--delay-every",
        str(every),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__)
    ap.add_argument("--delay-ms", type=float, required=True, help="hold each answer this long")
    ap.add_argument("--delay-every", type=int, default=1, help="rooms whose number is a multiple")
    add_decode_args(ap)
    ns = ap.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    delay = TransferDelay(ns.delay_ms, ns.delay_every)
    return run_decode(ns, PROG, delay)


if __name__ == "__main__":
    sys.exit(main())
