"""Subcommands of the `mpprefill` CLI."""

from __future__ import annotations

import argparse

from mpprefill.cli import command
from mpprefill.config import ServerArgs


def _serve_args(ap: argparse.ArgumentParser) -> None:
    ServerArgs.add_cli_args(ap)


@command("serve", "prefill scheduler and its forward worker", _serve_args)
def serve(args: argparse.Namespace) -> int:
    from mpprefill.server import run_serve

    try:
        server_args = ServerArgs.from_cli(args)
        server_args.resolved_forward_mode  # noqa: B018 - validates the mode and env aliases
    except ValueError as e:
        raise SystemExit(f"mpprefill serve: {e}") from None
    return run_serve(server_args)


def _decode_args(ap: argparse.ArgumentParser) -> None:
    from mpprefill.disagg.decode_args import add_decode_args

    add_decode_args(ap)


@command("decode", "decode receiver: the KV destination", _decode_args)
def decode(args: argparse.Namespace) -> int:
    from mpprefill.disagg.decode_args import run_decode

    return run_decode(args)
