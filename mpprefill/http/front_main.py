"""`python -m mpprefill.http`: the HTTP front's flags, its tokenizer, and uvicorn serving
until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

import ipc
from mpprefill import ports
from mpprefill.flags import add_flags, from_namespace
from mpprefill.http.args import HttpArgs
from mpprefill.http.auth import API_KEY_ENV
from mpprefill.http.chat_template import ChatTemplate
from mpprefill.http.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 5  # requests still waiting then are cancelled (and aborted)


def load_tokenizer(args: HttpArgs) -> TextTokenizer | None:
    """The tokenizer, or None for ids only; a dir without tokenizer.json is an error.
    Without a dir, the built-in model's byte-level tokenizer where its vocabulary is given."""
    path = args.resolved_tokenizer_path
    if path is None:
        if args.skip_tokenizer_init or args.vocab_size is None:
            return None
        return TextTokenizer.builtin(args.vocab_size)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise SystemExit(
            f"no tokenizer.json in {path}: give --tokenizer-path or --skip-tokenizer-init"
        )
    return TextTokenizer(path)


def load_chat_template(args: HttpArgs, tokenizer: TextTokenizer | None) -> ChatTemplate | None:
    """--chat-template, else the model dir's, else the built-in tokenizer's; None without a
    tokenizer (chat then answers 400). A template that cannot be read ends the front here."""
    if tokenizer is None:
        return None
    try:
        return ChatTemplate.load(tokenizer.path, args.chat_template, tokenizer.path is None)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--chat-template: {e}") from None


def _tokenizer_name(tokenizer: TextTokenizer | None) -> str:
    if tokenizer is None:
        return "none (ids only)"
    return tokenizer.path or "built-in byte-level"


def listener(args: HttpArgs) -> socket.socket:
    """The socket to serve on: the one inherited, or --host:--port bound here
    (ports.PortUnavailable if it cannot be)."""
    if args.listen_fd is not None:
        return socket.socket(fileno=args.listen_fd)
    return ports.listen_socket(args.host, ports.Listen("--port", args.port))


def run_http(args: HttpArgs) -> int:
    import uvicorn

    from mpprefill.http.app import build_app

    if args.parent_pid is not None and not ipc.die_with_parent(args.parent_pid, signal.SIGTERM):
        logger.warning("the server process %d is gone; the HTTP front exits", args.parent_pid)
        return 1
    try:
        sock = listener(args)
    except ports.PortUnavailable as e:
        return ports.report(e, "python -m mpprefill.http")
    tokenizer = load_tokenizer(args)
    template = load_chat_template(args, tokenizer)
    logger.info(
        "HTTP front on %s:%d for the scheduler at %s, tokenizer %s",
        args.host,
        args.port,
        args.zmq_address,
        _tokenizer_name(tokenizer),
    )
    config = uvicorn.Config(
        build_app(args, tokenizer, template),
        host=args.host,
        port=args.port,
        loop="asyncio",
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpprefill.http", description=__doc__)
    add_flags(ap, HttpArgs)
    ns = ap.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_http(from_namespace(HttpArgs, ns, api_key=api_key(ns.api_key)))


def api_key(given: str | None) -> str | None:
    """--api-key, else $MPPREFILL_API_KEY (unset or empty: no key)."""
    return given if given is not None else os.environ.get(API_KEY_ENV) or None
