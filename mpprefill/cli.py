"""The `mpprefill` command: one subcommand per process kind."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {}


def command(name: str, help: str, add_args: Callable[[argparse.ArgumentParser], None]):
    """Register `fn(args) -> int` as subcommand `name`."""

    def wrap(fn):
        _COMMANDS[name] = (help, add_args, fn)
        return fn

    return wrap


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    ap = argparse.ArgumentParser(prog="mpprefill", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (help, add_args, _) in _COMMANDS.items():
        p = sub.add_parser(name, help=help, description=help)
        add_args(p)
    return ap


def _load_commands() -> None:
    import importlib

    for mod in ("mpprefill.commands", "mpprefill.bench.commands"):
        importlib.import_module(mod)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(_COMMANDS[args.command][2](args) or 0)
