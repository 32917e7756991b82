"""`mpprefill decode`: the decode server's flags, and serving until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

import ipc
from mpprefill import ports
from mpprefill.decode import server
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.delay import TransferDelay
from mpprefill.flags import add_flags, from_namespace


def add_decode_args(ap: argparse.ArgumentParser) -> None:
    add_flags(ap, DecodeArgs)


def run_decode(
    ns: argparse.Namespace, prog: str = "mpprefill decode", delay: TransferDelay | None = None
) -> int:
    """Serve until SIGINT/SIGTERM, then clean up. `delay`: a test hook (decode/delay.py)."""
    try:
        args = from_namespace(DecodeArgs, ns)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}") from None
    try:
        srv = server.DecodeServer(args, delay)
    except ports.PortUnavailable as e:
        return ports.report(e, prog)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: srv.stop())
        ipc.install_signal_cleanup()
    try:
        srv.serve_forever()
    finally:
        srv.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m mpprefill.decode`: the same command without the `mpprefill` CLI."""
    ap = argparse.ArgumentParser(prog="mpprefill-decode", description=server.__doc__)
    add_decode_args(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_decode(args, "python -m mpprefill.decode")
