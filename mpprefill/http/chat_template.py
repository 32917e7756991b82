"""Chat messages to a prompt through a model's jinja chat template, rendered as transformers'
`apply_chat_template(..., tokenize=False)` renders it.

The template: an override (a file, a template string, or the name of one of the model's
templates); else the model dir's `chat_template.jinja` and `additional_chat_templates/
*.jinja` (named by their files); else `tokenizer_config.json`'s `chat_template`, a string
or a list of named ones. Of named templates, `tool_use` serves a request with tools where
the model has one, `default` the others. Without a model dir, the built-in tokenizer's
template and special tokens stand in where `builtin_default` says so.

The environment is transformers': sandboxed and immutable, `trim_blocks` and
`lstrip_blocks`, loop controls, a `{% generation %}` block that renders its body, the
`raise_exception` and `strftime_now` globals, and a `tojson` that leaves non-ASCII and
HTML characters as they are. The variables: `messages` (keys whose value is None dropped,
a message's reasoning under `reasoning_content` and `thinking` too), `tools`, `documents`,
`add_generation_prompt`, the special tokens of tokenizer_config.json (`bos_token`,
`eos_token`, ...), then any extra keyword, which wins over a special token.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mpprefill.http.tokenizer import BUILTIN_CONFIG, read_config

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str]):
        """`templates` by name, one of them `default`. A template that does not parse is a
        ValueError."""
        if "default" not in templates:
            raise ValueError(f"chat templates {sorted(templates)} name none `default`")
        env = _environment()
        try:
            self._compiled = {name: env.from_string(t) for name, t in templates.items()}
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template line {e.lineno}: {e.message}") from e
        self.templates = templates
        self.special_tokens = special_tokens

    @classmethod
    def load(
        cls, model_dir: str | None, override: str | None, builtin_default: bool
    ) -> ChatTemplate | None:
        """The model's template (see the module's docstring); None where it has none."""
        if model_dir is not None:
            config = read_config(model_dir)
            templates = _dir_templates(model_dir) or _config_templates(config)
        else:
            config = BUILTIN_CONFIG if builtin_default else {}
            templates = _config_templates(config)
        if override is not None:
            templates = {"default": _override(override, templates)}
        if not templates:
            return None
        return cls(templates, _special_tokens(config, model_dir))

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt; an error the template raises (`raise_exception`, an undefined name
        used) is a ValueError with its message."""
        name = "tool_use" if tools is not None and "tool_use" in self._compiled else "default"
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._compiled[name].render(
                messages=[_message(m) for m in messages],
                tools=tools,
                documents=variables.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.TemplateError, TypeError) as e:
            raise ValueError(f"chat template: {e}") from e


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`, which marks the assistant's part of a
    conversation for training; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _message(message: dict) -> dict:
    """A message as a template sees it: no None values, the reasoning under its names."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _dir_templates(model_dir: str) -> dict[str, str]:
    templates = {}
    file = os.path.join(model_dir, TEMPLATE_FILE)
    if os.path.isfile(file):
        templates["default"] = _read(file)
    folder = os.path.join(model_dir, TEMPLATE_DIR)
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".jinja"):
                templates[name.removesuffix(".jinja")] = _read(os.path.join(folder, name))
    return templates


def _config_templates(config: dict[str, Any]) -> dict[str, str]:
    template = config.get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return {}


def _override(value: str, templates: dict[str, str]) -> str:
    """An override: the name of one of the model's templates, a file, or the template."""
    if value in templates:
        return templates[value]
    if os.path.isfile(value):
        return _read(value)
    if "{" not in value:
        raise FileNotFoundError(f"chat template {value!r}: no such file or template name")
    return value


def _special_tokens(config: dict[str, Any], model_dir: str | None) -> dict[str, str]:
    """The named special tokens, as strings: tokenizer_config.json's, then those of
    special_tokens_map.json that it lacks."""
    extra = {}
    file = os.path.join(model_dir, "special_tokens_map.json") if model_dir else ""
    if file and os.path.isfile(file):
        with open(file) as f:
            extra = json.load(f)
    tokens = {}
    for name in SPECIAL_TOKENS:
        token = config.get(name) or extra.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            tokens[name] = token
    return tokens


def _read(file: str) -> str:
    with open(file, encoding="utf-8") as f:
        return f.read()
