"""Subcommands of the `mpprefill` CLI."""

from __future__ import annotations

import argparse

from mpprefill import ports
from mpprefill.cli import command
from mpprefill.config import ServerArgs
from mpprefill.flags import add_flags, from_namespace


def _serve_args(ap: argparse.ArgumentParser) -> None:
    add_flags(ap, ServerArgs)


@command("serve", "prefill scheduler and its forward worker", _serve_args)
def serve(args: argparse.Namespace) -> int:
    from mpprefill.server.server import run_serve

    try:
        server_args = from_namespace(ServerArgs, args)  # resolves the mode and env aliases
        server_args = size_kv_pool(server_args)
    except ValueError as e:
        raise SystemExit(f"mpprefill serve: {e}") from None
    try:
        return run_serve(server_args)
    except ports.PortUnavailable as e:
        return ports.report(e, "mpprefill serve")


def size_kv_pool(args: ServerArgs, memory=None) -> ServerArgs:
    """`args` with its KV pool sized: --max-total-tokens as given (or the CPU's default),
    else, on CUDA, what --mem-fraction-static leaves of the devices' free memory
    (`worker.build.pool_tokens`; `memory`: its probe of (free, total) bytes)."""
    if args.max_total_tokens is not None:
        return args
    from mpprefill.worker.build import pool_tokens

    cfg = args.worker_config()
    tokens = pool_tokens(cfg) if memory is None else pool_tokens(cfg, memory)
    return args.replace(max_total_tokens=tokens)


def _decode_args(ap: argparse.ArgumentParser) -> None:
    from mpprefill.decode.command import add_decode_args

    add_decode_args(ap)


@command("decode", "decode receiver: the KV destination", _decode_args)
def decode(args: argparse.Namespace) -> int:
    from mpprefill.decode.command import run_decode

    return run_decode(args)
