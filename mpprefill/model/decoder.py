"""The decoder-only causal LM every family is: embedding, decoder layers (attention, or
latent attention, and a gated MLP, dense or a mixture of experts, each behind an RMS norm,
with residuals), final norm and head, over a paged KV cache, prefill only. A family
subclasses `CausalLM`: it names its architecture, reads its config.json and says which
optional layers it wires in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model.attention import make_backend
from mpprefill.model.config import ModelConfig
from mpprefill.model.forward_batch import ForwardBatch
from mpprefill.model.layers.attention import Attention, LayerContext
from mpprefill.model.layers.linear import VocabParallelEmbedding, VocabParallelHead
from mpprefill.model.layers.mla import LatentAttention, LatentPlan
from mpprefill.model.layers.mlp import GatedMLP
from mpprefill.model.layers.moe import ExpertNames, SparseMoE
from mpprefill.model.layers.norm import QKNorm, RMSNorm
from mpprefill.model.layers.rotary import Rotary
from mpprefill.model.parallel import WHOLE, ShardEntry, TPRank, shard_config, span

_NORMS = (RMSNorm, QKNorm)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        tp: TPRank | None = None,
        qk_norm: bool = False,
        stacked_experts: bool = False,
    ) -> None:
        super().__init__()
        if config.is_latent:
            self.attention = LatentAttention(config, layer_id, tp)
        else:
            self.attention = Attention(config, layer_id, tp, qk_norm)
        if config.is_moe(layer_id):
            self.feed_forward = SparseMoE(config, tp, stacked=stacked_experts)
        else:
            self.feed_forward = GatedMLP(config, tp)
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: LayerContext, locs: Tensor, plan: Any) -> Tensor:
        h = x + self.attention(self.attention_norm(x), ctx, locs, plan)
        return h + self.feed_forward(self.ffn_norm(h))

    @staticmethod
    def shard_table(
        config: ModelConfig, tp: TPRank, i: int, qk_norm: bool, experts: ExpertNames
    ) -> dict[str, ShardEntry]:
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        if config.is_latent:
            table = LatentAttention.shard_table(config, tp, f"{hf}self_attn.", f"{ours}attention.")
        else:
            table = Attention.shard_table(
                config, tp, f"{hf}self_attn.", f"{ours}attention.", qk_norm
            )
        if config.is_moe(i):
            table |= SparseMoE.shard_table(config, tp, hf, f"{ours}feed_forward.", experts)
        else:
            table |= GatedMLP.shard_table(config, tp, f"{hf}mlp.", f"{ours}feed_forward.")
        for norm, mine in (
            ("input_layernorm", "attention_norm"),
            ("post_attention_layernorm", "ffn_norm"),
        ):
            table[f"{hf}{norm}.weight"] = (f"{ours}{mine}.weight", WHOLE, WHOLE, WHOLE)
        return table


class CausalLM(nn.Module):
    """Weights start uninitialised: call init_random_weights() or load a state dict.

    With `tp` of several ranks the model holds one rank's shard (see `parallel.py`): its
    heads and MLP rows (`kv_config`, the shape its KV pool takes) and its vocabulary rows;
    `config` stays the whole model's."""

    architecture: ClassVar[str] = ""
    model_type: ClassVar[str] = ""  # config.json's model_type
    qk_norm: ClassVar[bool] = False  # per-head RMS norm of q and k before the rotary
    expert_names: ClassVar[ExpertNames] = ExpertNames()  # an MoE layer's checkpoint names

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """The family's reading of an HF config.json dict; unsupported fields raise."""
        raise NotImplementedError

    @classmethod
    def shard_table(cls, config: ModelConfig, tp: TPRank) -> dict[str, ShardEntry]:
        """HF tensor name -> where rank `tp.rank`'s part of it goes."""
        vocab = span(tp.vocab(config), 1)
        local_vocab = slice(0, vocab.stop - vocab.start)
        table = {
            "model.embed_tokens.weight": ("tok_embeddings.weight", local_vocab, vocab, WHOLE),
            "model.norm.weight": ("norm.weight", WHOLE, WHOLE, WHOLE),
        }
        if not config.tie_word_embeddings:
            table["lm_head.weight"] = ("output.weight", local_vocab, vocab, WHOLE)
        for i in range(config.num_hidden_layers):
            table |= DecoderLayer.shard_table(config, tp, i, cls.qk_norm, cls.expert_names)
        return table

    def __init__(
        self, config: ModelConfig, device: torch.device | str = "cpu", tp: TPRank | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.kv_config = config if self.tp is None else shard_config(config, self.tp)
        with torch.device("meta"):
            self._build(config)
        self.to(config.torch_dtype)
        self._keep_float32()
        self.to_empty(device=device)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.requires_grad_(False).eval()
        self.rotary = Rotary(config, device)
        self.set_attention_backend("auto")

    def _build(self, config: ModelConfig) -> None:
        tp, local = self.tp, self.kv_config
        if tp is None:
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.tok_embeddings = VocabParallelEmbedding(config, tp)
        layers = range(config.num_hidden_layers)
        self.layers = nn.ModuleList(
            DecoderLayer(local, i, tp, self.qk_norm, self.expert_names.stacked) for i in layers
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if tp is None:
            self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.output = VocabParallelHead(config, tp)

    def _keep_float32(self) -> None:
        """Parameters a layer names in `float32_params` (DeepSeek's router) stay float32,
        as transformers keeps them, whatever the model's dtype."""
        for module in self.modules():
            for name in getattr(module, "float32_params", ()):
                module.get_parameter(name).data = module.get_parameter(name).data.float()

    @torch.inference_mode()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Seeded normal(0, std) weights and unit norms; same seed, same bits, any process."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if isinstance(self.get_submodule(name.rpartition(".")[0]), _NORMS):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def set_attention_backend(self, name: str) -> None:
        """`--attention-backend`: see `attention.make_backend`."""
        self.attention_backend = make_backend(name, self.device, self.config.torch_dtype)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, kv: KVCache, on_layer: Callable[[int], None] | None = None
    ) -> Tensor:
        """Float32 logits [B, vocab] at each request's last new token. `on_layer(i)` runs
        once layer i's work is issued (an emulated device charges its time there).

        The host reads only the batch's host lengths (see `ForwardBatch`)."""
        x = self.tok_embeddings(fb.input_ids)
        cos, sin = self.rotary.at(fb.positions, fb.max_seq_len, x.dtype)
        ctx = LayerContext(kv, cos, sin, self.attention_backend)
        backend = self.attention_backend
        if self.config.is_latent:
            full = (fb.out_cache_loc, LatentPlan.of(backend, fb))
        else:
            full = (fb.out_cache_loc, backend.plan(fb, fb.kv_indices, None))
        sliding = full
        if self.config.has_sliding_layers:
            swa_locs, swa_indices = fb.swa_slots()
            sliding = (swa_locs, backend.plan(fb, swa_indices, self.config.sliding_window))
        for i, layer in enumerate(self.layers):
            locs, plan = sliding if self.config.is_sliding(i) else full
            x = layer(x, ctx, locs, plan)
            if on_layer is not None:
                on_layer(i)
        x = x.index_select(0, fb.last_token_indices)
        return self.output(self.norm(x)).float()
