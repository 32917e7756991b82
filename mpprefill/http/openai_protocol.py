"""The OpenAI-compatible request bodies (`/v1/completions`, `/v1/chat/completions`) as
pydantic models, and what each becomes: the prompts, and one SGLang `sampling_params`
object per choice.

A body's fields are OpenAI's plus SGLang's extras (`top_k`, `min_p`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `no_stop_trim`, `skip_special_tokens`, `rid`,
`bootstrap_*`), and the fields sglang-router writes into every body it forwards with their
default values (`continue_final_message`, `separate_reasoning`, ...). A field no server here
implements is refused with a 400 naming it once it asks for something (`regex`,
`json_schema`, `ebnf`, `tools`, `logit_bias`, ...); an unknown field is a 400 too: nothing
is accepted and then ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mpprefill.http.errors import bad_request
from mpprefill.sampling.params import MAX_TOP_LOGPROBS  # OpenAI's bound for chat too

MAX_N = 64  # choices per prompt
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Fields a server here does not implement: (name, the value that asks for nothing). A body
# that gives one with any other value is refused, naming it.
_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("regex", None),
    ("json_schema", None),
    ("ebnf", None),
    ("structural_tag", None),
    ("logit_bias", None),
    ("min_tokens", 0),
    ("lora_path", None),
    ("return_hidden_states", False),
    ("custom_logit_processor", None),
    ("tools", None),
    ("functions", None),
    ("suffix", None),
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_Strict):
    """What both routes take."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    rid: str | list[str] | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    # not implemented: refused when they ask for something (_UNSUPPORTED)
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    lora_path: Any = None
    return_hidden_states: bool = False
    custom_logit_processor: Any = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if any(not s for s in stops):
            raise bad_request("stop strings must not be empty")
        return stops

    def refuse_unsupported(self) -> None:
        for name, neutral in _UNSUPPORTED:
            value = getattr(self, name, neutral)
            if value is not None and value != neutral and value != {}:
                raise bad_request(f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true")


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported by this server (other than equal to n)")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs the prompt's logprobs: not supported")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p):
            return list(p)
        return [list(x) for x in p]

    @property
    def top_logprobs_num(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k best alternatives."""
        return self.logprobs


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template reads it: content as one string."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    # without a reasoning parser (none here) these change nothing, as in SGLang
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request(f"response_format {self.response_format.type} is not supported")
        if self.tool_choice not in (None, "none") and self.tools:
            raise bad_request("tool_choice is not supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last")

    @property
    def top_logprobs_num(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]


def parse(model: type[_Common], obj: Any) -> _Common:
    """The body as `model`; HttpError(400) naming the first field that is wrong."""
    if not isinstance(obj, dict):
        raise bad_request("the body must be a JSON object")
    try:
        body = model.model_validate(obj)
    except ValidationError as e:
        raise bad_request(_first_error(e)) from None
    body.refuse_unsupported()
    return body


def _first_error(e: ValidationError) -> str:
    err = e.errors(include_url=False)[0]
    where = ".".join(str(part) for part in err["loc"]) or "body"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    return f"{where}: {err['msg']}"


def sampling_params(
    body: _Common, max_new_tokens: int, choice: int, stop_token_ids: list[int] | None = None
) -> dict[str, Any]:
    """SGLang's `sampling_params` for one choice. Unset fields keep SGLang's defaults; a
    seed is offset by the choice's index, so that n seeded choices differ and each repeats."""
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(body, name)
        if value is not None:
            params[name] = value
    if body.seed is not None:
        params["seed"] = body.seed + choice
    ids = list(body.stop_token_ids or ()) + list(stop_token_ids or ())
    if ids:
        params["stop_token_ids"] = ids
    if body.ignore_eos:
        params["ignore_eos"] = True
    k = body.top_logprobs_num
    if k is not None:
        params["return_logprob"] = True
        params["top_logprobs_num"] = k
    params["skip_special_tokens"] = body.skip_special_tokens
    return params


def requested_max_tokens(body: _Common) -> int | None:
    """The body's output limit; None: up to the context length."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    if body.max_tokens is not None:
        return body.max_tokens
    return COMPLETION_MAX_TOKENS if isinstance(body, CompletionRequest) else None


def fan_out(value: Any, name: str, count: int) -> list[Any]:
    """A per-request field for `count` requests: a list of `count`, or one value; one value
    shared by several requests is refused for the bootstrap room (two requests cannot
    share one)."""
    if isinstance(value, list):
        if len(value) != count:
            raise bad_request(f"{name} has {len(value)} entries for {count} requests")
        return value
    if value is not None and count > 1 and name == "bootstrap_room":
        raise bad_request(f"{count} requests need {count} bootstrap rooms, a list")
    return [value] * count
