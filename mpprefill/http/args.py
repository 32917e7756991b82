"""The HTTP front's settings: one frozen dataclass whose fields are its flags
(mpprefill.flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mpprefill.flags import option


@dataclass(frozen=True)
class HttpArgs:
    zmq_address: str = option("127.0.0.1:30100", "the prefill server's request socket, host:port")
    host: str = option("127.0.0.1", "address the HTTP server binds to")
    port: int = option(30000, "HTTP port")
    model_path: str | None = option(
        None, "the served model's dir; its tokenizer.json turns text into ids and back"
    )
    tokenizer_path: str | None = option(None, "tokenizer dir (default: --model-path)")
    served_model_name: str | None = option(
        None,
        "the model's name in the OpenAI routes' replies and /v1/models (default: --model-path)",
    )
    chat_template: str | None = option(
        None,
        "the chat template for /v1/chat/completions: a jinja file or the template itself"
        " (default: the model dir's chat_template.jinja or tokenizer_config.json's)",
    )
    vocab_size: int | None = option(
        None,
        "without --model-path: the built-in model's vocabulary, which sizes its byte-level"
        " tokenizer (the servers pass it; absent: ids only)",
    )
    skip_tokenizer_init: bool = option(
        False, "ids only: no tokenizer, `text` input refused (the default without a model dir)"
    )
    max_body_bytes: int = option(
        32 << 20,
        "request bodies larger than this get 413, before any of them is parsed. The largest"
        " legitimate body is a batch of long prompts as input_ids: at most 8 bytes a token"
        " ('128255, '), so 16 prompts at a 128k context take 16 MiB; the default is twice"
        " that (a prompt's frame to the server holds at most 4 MiB anyway)",
    )
    request_timeout: float = option(600.0, "seconds a request waits for the scheduler's reply")
    health_timeout: float = option(10.0, "seconds /health waits for the scheduler's stats")
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "every route but /health needs `Authorization: Bearer KEY` (else 401);"
            " default $MPPREFILL_API_KEY, which keeps the key off the command line that ps"
            " shows (`mpprefill serve` and `decode` pass theirs so)"
        },
    )
    log_level: str = option("info", "logging level")
    parent_pid: int | None = option(
        None, "exit when this process exits (`mpprefill serve` and `decode` pass their own pid)"
    )
    listen_fd: int | None = option(
        None,
        "serve on this inherited socket, already bound to --host:--port and listening"
        " (`mpprefill serve` and `decode` bind it when they start), instead of binding here",
    )

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError("--max-body-bytes must be positive")
        if min(self.request_timeout, self.health_timeout) <= 0:
            raise ValueError("--request-timeout and --health-timeout must be positive")
        if ":" not in self.zmq_address.rpartition("://")[2]:
            raise ValueError(f"--zmq-address must be host:port, got {self.zmq_address!r}")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty")

    @property
    def resolved_tokenizer_path(self) -> str | None:
        """Where the tokenizer is read from; None: the built-in one, or ids only."""
        if self.skip_tokenizer_init:
            return None
        return self.tokenizer_path or self.model_path
