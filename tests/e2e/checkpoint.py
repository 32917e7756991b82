"""A small random Hugging Face checkpoint with a tokenizer trained here, and its greedy
`generate` as computed by transformers: the oracle of the deployment tests. Nothing is
downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

VOCAB = 384
DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
# An architecture's own fields: few experts, top-2; DeepSeek-V3's latent attention at small
# ranks (one KV head per query head, as it requires), a dense first layer, grouped routing.
OWN_FIELDS = {
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen3MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "DeepseekV3ForCausalLM": dict(
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
}
SPECIALS = ["<unk>", "<s>", "</s>"]
BOS, EOS = 1, 2
CORPUS = [
    "the prefill side computes the prompt and the decode side generates the rest",
    "a radix tree keeps the prefixes that requests share, page by page",
    "pages of keys and values travel from one server to the other",
    "one process issues the forward while another schedules the next batch",
    "numbers like 12 345 6789 and words like alpha beta gamma delta",
]

# ChatML, as Qwen2's instruct checkpoints write it (the markers are plain text here)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def save_checkpoint(path: Path, arch: str = "Qwen2ForCausalLM", seed: int = 0) -> Path:
    """`arch` with random weights (every tensor perturbed, so no weight is trivially zero),
    `generation_config.json` naming EOS, and a byte-level BPE tokenizer trained on CORPUS
    whose ids fit the model's vocabulary; an architecture in OWN_FIELDS gets its fields. Llama
    and Mixtral checkpoints prepend BOS (tokenizer_config's `add_bos_token`); Qwen ones do
    not, as the real ones."""
    transformers = pytest.importorskip("transformers", reason="the oracle is transformers")
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizer is trained with it")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    fields = {**DIMS, **OWN_FIELDS.get(arch, {})}
    config = config_cls(**fields, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    model.generation_config.save_pretrained(str(path))

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(path / "tokenizer.json"))
    tok_config = {
        "add_bos_token": arch.startswith(("Llama", "Mixtral")),
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def greedy_reference(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` of each prompt alone, EOS from the checkpoint: the
    completion tokens only (EOS included when it stopped there)."""
    transformers = pytest.importorskip("transformers", reason="the oracle is transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval().float()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=EOS,
                pad_token_id=EOS,
            )
            out.append(y[0, len(ids) :].tolist())
    return out


def encode(path: Path, text: str) -> list[int]:
    """The prompt ids the servers' tokenizer makes of `text` (BOS as configured)."""
    from mpprefill.http.tokenizer import TextTokenizer

    return TextTokenizer(str(path)).encode([text])[0]


def chat_ids(path: Path, messages: list[dict]) -> list[int]:
    """transformers' prompt ids of a chat: the checkpoint's template, rendered and encoded
    by its tokenizer.json as `apply_chat_template` does. NOTE: PreTrainedTokenizerFast,
    not AutoTokenizer, whose Qwen2 class rebuilds the tokenizer with its own pre-tokenizer
    rather than the file's."""
    transformers = pytest.importorskip("transformers", reason="the oracle is transformers")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])  # a BatchEncoding


def decode_text(path: Path, ids: list[int]) -> str:
    """transformers' text of output ids, special tokens skipped."""
    transformers = pytest.importorskip("transformers", reason="the oracle is transformers")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    return tok.decode(ids, skip_special_tokens=True)


def reference_logprobs(path: Path, prompt: list[int], output: list[int]) -> list[torch.Tensor]:
    """log_softmax of transformers' logits at each output token's position: row i is the
    distribution output[i] was drawn from."""
    transformers = pytest.importorskip("transformers", reason="the oracle is transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval().float()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    return list(torch.log_softmax(rows.float(), dim=-1))
