"""Chat templates rendered as transformers' `apply_chat_template(tokenize=False)` renders them
(the reference: PreTrainedTokenizerFast loading the same model dir), and the ids of a
rendered prompt as its `apply_chat_template(tokenize=True)`."""

from __future__ import annotations

import json
import re
from datetime import datetime

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from mpprefill.http.chat_template import ChatTemplate  # noqa: E402
from mpprefill.http.tokenizer import BUILTIN_CHAT_TEMPLATE, TextTokenizer  # noqa: E402
from tests.e2e.checkpoint import save_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# Qwen2-like: ChatML, a default system message, tools as JSON lines, tool calls and results.
CHATML = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls if message.tool_calls is defined %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
{{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Llama-3-like: BOS written by the template, headers, a dated system part, trimmed content.
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] | trim %}
{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
{%- if message['role'] not in ['user', 'assistant'] %}
{{- raise_exception("Only user and assistant roles are supported, not " + message['role']) }}
{%- endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

SYSTEM = {"role": "system", "content": "Be brief. Ünïcode → 世界 <b>&</b>"}
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hello 😀"}],
    "system": [SYSTEM, {"role": "user", "content": "  What is 2+2?  "}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke.\n"},
    ],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in <city> & region, é",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _model_dir(path, config: dict, tokenizer_dir=None):
    """A dir with the built-in tokenizer's tokenizer.json (or `tokenizer_dir`'s) and `config`
    as its tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        TextTokenizer.builtin(4096)._tok.save(str(path / "tokenizer.json"))
    else:
        (path / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _reference(path, messages, **kwargs) -> str:
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return _model_dir(tmp_path_factory.mktemp("chatml"), config)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    config = {
        "chat_template": LLAMA3,
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    }
    return _model_dir(tmp_path_factory.mktemp("llama"), config)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chatml_as_transformers(chatml_dir, name, gen, tools):
    template = ChatTemplate.load(str(chatml_dir), None, builtin_default=False)
    messages = CONVERSATIONS[name]
    got = template.render(messages, add_generation_prompt=gen, tools=tools)
    assert got == _reference(chatml_dir, messages, add_generation_prompt=gen, tools=tools)
    assert got.endswith("<|im_start|>assistant\n") == gen


def test_chatml_tool_calls_and_results_as_transformers(chatml_dir):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "1"}
            ],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "1"},
    ]
    template = ChatTemplate.load(str(chatml_dir), None, builtin_default=False)
    got = template.render(messages, tools=TOOLS)
    assert got == _reference(chatml_dir, messages, add_generation_prompt=True, tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in got


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_llama3_as_transformers(llama_dir, name, gen):
    template = ChatTemplate.load(str(llama_dir), None, builtin_default=False)
    messages = CONVERSATIONS[name]
    got = template.render(messages, add_generation_prompt=gen, date_string="26 Jul 2024")
    ref = _reference(llama_dir, messages, add_generation_prompt=gen, date_string="26 Jul 2024")
    assert got == ref
    assert got.startswith("<|begin_of_text|><|start_header_id|>system")


def test_strftime_now_dates_the_prompt(llama_dir):
    got = ChatTemplate.load(str(llama_dir), None, False).render(CONVERSATIONS["one turn"])
    date = re.search(r"Today Date: (\d\d \w{3} \d{4})\n", got).group(1)
    assert abs((datetime.strptime(date, "%d %b %Y") - datetime.now()).days) <= 1


def test_raise_exception_is_a_value_error_with_the_templates_message(llama_dir):
    template = ChatTemplate.load(str(llama_dir), None, builtin_default=False)
    messages = [{"role": "tool", "content": "x"}]
    with pytest.raises(ValueError, match="Only user and assistant roles are supported, not tool"):
        template.render(messages)
    with pytest.raises(Exception, match="Only user and assistant roles are supported, not tool"):
        _reference(llama_dir, messages)


def test_undefined_names_and_bad_syntax_are_value_errors():
    template = ChatTemplate({"default": "{{ messages[0].nope.deeper }}"}, {})
    with pytest.raises(ValueError, match="nope"):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="chat template"):
        ChatTemplate({"default": "{% for m in messages %}"}, {})


def test_the_sandbox_holds():
    template = ChatTemplate({"default": "{{ messages.__class__.__mro__ }}"}, {})
    with pytest.raises(ValueError):
        template.render([])
    template = ChatTemplate({"default": "{% set _ = messages.append(1) %}"}, {})
    with pytest.raises(ValueError):
        template.render([])


def test_template_file_and_named_templates_as_transformers(tmp_path):
    named = [
        {"name": "default", "template": "D{% for m in messages %}|{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | tojson(indent=2) }}{{ eos_token }}"},
    ]
    path = _model_dir(tmp_path / "named", {"chat_template": named, "eos_token": "<|eos|>"})
    template = ChatTemplate.load(str(path), None, builtin_default=False)
    messages = CONVERSATIONS["multi-turn"]
    assert (
        template.render(messages)
        == _reference(path, messages)
        == "D|" + "|".join(m["content"] for m in messages)
    )
    got = template.render(messages, tools=TOOLS)
    assert got == _reference(path, messages, tools=TOOLS)
    assert got.startswith("T[\n  {") and "<city> & region, é" in got
    # A chat_template.jinja file wins over the config's templates.
    (path / "chat_template.jinja").write_text("F{{ messages | length }}{{ bos_token }}")
    template = ChatTemplate.load(str(path), None, builtin_default=False)
    assert template.render(messages) == _reference(path, messages) == "F4"


def test_generation_prompt_and_extra_kwargs_as_transformers(tmp_path):
    text = (
        "{% for m in messages %}{% generation %}{{ m.role }}:{{ m.content }}"
        "{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %}"
        "{% endgeneration %}\n{% endfor %}{% if add_generation_prompt %}>{{ persona }}"
        "{% endif %}{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}"
        "{% endfor %}{{ eos_token }}"
    )
    path = _model_dir(tmp_path / "m", {"chat_template": text, "eos_token": "</s>"})
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning": "because"},
    ]
    template = ChatTemplate.load(str(path), None, builtin_default=False)
    for gen in (True, False):
        got = template.render(messages, add_generation_prompt=gen, persona="bot", eos_token="E")
        ref = _reference(path, messages, add_generation_prompt=gen, persona="bot", eos_token="E")
        assert got == ref
    assert got == "user:aassistant:b(because)01E"  # trim_blocks ate the newlines


def test_override_a_file_a_string_or_a_name(tmp_path, chatml_dir):
    file = tmp_path / "t.jinja"
    file.write_text("file:{{ messages[0].content }}")
    messages = CONVERSATIONS["one turn"]
    assert ChatTemplate.load(str(chatml_dir), str(file), False).render(messages) == "file:Hello 😀"
    string = "str:{{ eos_token }}"
    assert ChatTemplate.load(str(chatml_dir), string, False).render(messages) == "str:<|im_end|>"
    assert ChatTemplate.load(None, string, False).render(messages) == "str:"
    named = ChatTemplate.load(str(chatml_dir), "default", False)
    assert named.render(messages) == _reference(chatml_dir, messages, add_generation_prompt=True)
    with pytest.raises(FileNotFoundError):
        ChatTemplate.load(str(chatml_dir), str(tmp_path / "missing.jinja"), False)


def test_no_template_is_none_and_the_builtin_default_stands_in(tmp_path):
    path = _model_dir(tmp_path / "bare", {"bos_token": {"content": "<|bos|>"}})
    assert ChatTemplate.load(str(path), None, builtin_default=False) is None
    overridden = ChatTemplate.load(str(path), "{{ bos_token }}", builtin_default=False)
    assert overridden.special_tokens == {"bos_token": "<|bos|>"}
    assert ChatTemplate.load(None, None, builtin_default=False) is None
    builtin = ChatTemplate.load(None, None, builtin_default=True)
    assert builtin.templates == {"default": BUILTIN_CHAT_TEMPLATE}
    assert builtin.special_tokens == {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}


def _reference_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out


def test_builtin_chat_as_transformers_down_to_the_ids():
    ours = TextTokenizer.builtin(4096)
    ref = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours._tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        chat_template=BUILTIN_CHAT_TEMPLATE,
    )
    template = ChatTemplate.load(None, None, builtin_default=True)
    parts = [
        {"type": "text", "text": "two "},
        {"type": "image_url"},
        {"type": "text", "text": "parts"},
    ]
    for messages in [*CONVERSATIONS.values(), [{"role": "user", "content": parts}]]:
        prompt = template.render(messages)
        assert prompt == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        [ids] = ours.encode([prompt], add_special_tokens=False)
        assert ids == _reference_ids(ref, messages)
        assert ids.count(ours.bos_id) == 1
    assert "two parts<|im_end|>" in prompt


def test_a_bos_adding_tokenizer_encodes_a_rendered_prompt_without_a_second_bos(tmp_path):
    """A Llama-like checkpoint: its tokenizer prepends BOS and its template writes one."""
    ckpt = save_checkpoint(tmp_path / "llama", "LlamaForCausalLM")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    ours = TextTokenizer(str(ckpt))
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(ckpt))
    messages = [{"role": "user", "content": "the prefill side"}]
    prompt = ChatTemplate.load(str(ckpt), None, False).render(messages)
    [ids] = ours.encode([prompt], add_special_tokens=False)
    assert ids == _reference_ids(ref, messages)
    assert ids[0] == ours.bos_id == 1
    assert ids[1] != 1
    assert ours.encode([prompt])[0] == [1, *ids]  # the default adds one more, as configured
