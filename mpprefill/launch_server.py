"""`python -m mpprefill.launch_server --disaggregation-mode prefill|decode ...`: SGLang's
entry point and role flag, so an SGLang launch line runs with the module name changed.

`prefill` starts `mpprefill serve`, `decode` starts `mpprefill decode`, each with the rest
of the flags; mpprefill serves only these two roles, so `null` (SGLang's default, a
server that does both) or no role at all is an error."""

from __future__ import annotations

import argparse
import sys

from mpprefill import cli

PROG = "python -m mpprefill.launch_server"
ROLES = {"prefill": "serve", "decode": "decode"}


def _role_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    ap.add_argument("--disaggregation-mode", choices=(*ROLES, "null"), default="null")
    return ap


def translate(argv: list[str]) -> list[str]:
    """The `mpprefill` command line of an SGLang-shaped one: the subcommand of its
    --disaggregation-mode, then the other flags in their order. SystemExit (argparse's
    usage error, status 2) for a role mpprefill does not serve."""
    ap = _role_parser()
    known, rest = ap.parse_known_args(argv)
    mode = known.disaggregation_mode
    if mode not in ROLES:
        ap.error(
            f"--disaggregation-mode {mode}: mpprefill serves only disaggregated roles; give"
            " --disaggregation-mode prefill (mpprefill serve) or decode (mpprefill decode)"
        )
    return [ROLES[mode], *rest]


def main(argv: list[str] | None = None) -> None:
    cli.main(translate(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
