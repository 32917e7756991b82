"""Tensor parallelism, Megatron-style, over torch.distributed: which shard of the decoder
a rank holds, and the layers whose outputs need a collective.

| weight             | split      | rank r of N holds                           | then       |
|--------------------|------------|---------------------------------------------|------------|
| embed_tokens       | vocab rows | rows [r * V', (r + 1) * V'), V' = ceil(V/N) | all-reduce |
| q_proj             | heads      | query heads [r * H / N, (r + 1) * H / N)    |            |
| k_proj, v_proj     | KV heads   | KV / N heads; when KV < N, the one its      |            |
|                    |            | query heads read (held by N / KV ranks)     |            |
| o_proj             | columns    | the columns of its query heads              | all-reduce |
| gate_proj, up_proj | rows       | rows [r * I / N, (r + 1) * I / N)           |            |
| down_proj          | columns    | the columns of its gate/up rows             | all-reduce |
| experts' gate/up   | rows       | every expert's rows [r * I_e / N, ...)      |            |
| experts' down      | columns    | every expert's columns of its gate/up rows  | all-reduce |
| shared experts     | as an MLP  | as gate/up/down_proj, of their I_s rows     | all-reduce |
| gpt-oss gate_up,   | columns,   | every expert's columns [2 r I_e / N, ...)   |            |
| down_proj          | rows       | (gate and up interleaved); its down rows    | all-reduce |
| experts' biases    | as above   | gate/up: its columns; down: whole, added    |            |
|                    |            | by rank 0 only                              |            |
| sinks              | heads      | those of its query heads                    |            |
| router (gate)      | none       | all of it                                   |            |
| MLA q_proj,        | heads      | its heads' rows (q_a_proj and q_a_layernorm |            |
| q_b_proj           |            | before q_b_proj: whole)                     |            |
| MLA kv_b_proj      | heads      | its heads' K (nope part) and V rows         |            |
| MLA o_proj         | columns    | the columns of its heads                    | all-reduce |
| MLA kv_a_proj,     | none       | all of it: every rank computes the same     |            |
| kv_a_layernorm     |            | latent rows into its own pool (replicated)  |            |
| lm_head            | vocab rows | as embed_tokens (tied: the same tensor)     | all-gather |
| norms, o_proj bias | none       | all of it                                   |            |

Every rank sees the whole hidden state between layers and the whole logits at the end;
its KV pool holds only its KV heads, or with latent attention every token's latent row. At
one rank the model has none of the parallel layers (`layers/linear.py`) and calls no
collective. Per-head weights (Qwen3's q/k norms) are whole on every rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mpprefill.model.config import ModelConfig


@dataclass(frozen=True)
class TPRank:
    """This process's place in a tensor-parallel group (`group`: None is the default
    process group)."""

    rank: int
    size: int
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is out of range")

    def heads(self, config: ModelConfig) -> range:
        """The query heads this rank computes."""
        n = config.num_attention_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, config: ModelConfig) -> range:
        """The KV heads this rank holds; with fewer KV heads than ranks each is held by
        size / KV ranks, the ones whose query heads read it."""
        kv = config.num_key_value_heads
        if kv >= self.size:
            n = kv // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        head = self.rank // (self.size // kv)
        return range(head, head + 1)

    def intermediate(self, config: ModelConfig) -> range:
        n = config.intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def moe_intermediate(self, config: ModelConfig) -> range:
        """Each expert's MLP rows this rank holds (every rank holds every expert)."""
        n = config.moe_intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def vocab_shard(self, config: ModelConfig) -> int:
        """Rows of each rank's embedding (the last rank's tail is zero padding)."""
        return math.ceil(config.vocab_size / self.size)

    def vocab(self, config: ModelConfig) -> range:
        n = self.vocab_shard(config)
        return range(
            min(self.rank * n, config.vocab_size), min((self.rank + 1) * n, config.vocab_size)
        )


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise unless the model splits evenly over `size` ranks."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads ({heads}) is not a multiple of it")
    if kv >= size and kv % size:
        problems.append(f"num_key_value_heads ({kv}) is not a multiple of it")
    if kv < size and size % kv:
        problems.append(f"it is not a multiple of num_key_value_heads ({kv})")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size ({config.intermediate_size}) is not a multiple of it")
    if config.moe_intermediate_size % size:
        moe = config.moe_intermediate_size
        problems.append(f"moe_intermediate_size ({moe}) is not a multiple of it")
    if config.shared_expert_intermediate_size % size:
        shared = config.shared_expert_intermediate_size
        problems.append(f"the shared experts' {shared} rows are not a multiple of it")
    if problems:
        raise ValueError(f"--tp-size {size}: " + "; ".join(problems))


def shard_config(config: ModelConfig, tp: TPRank) -> ModelConfig:
    """The shape of one rank's attention and MLP (and of its KV pool): its heads, its KV
    heads, its slice of the MLP; hidden size and vocabulary stay whole."""
    check_shardable(config, tp.size)
    return dataclasses.replace(
        config,
        num_attention_heads=len(tp.heads(config)),
        num_key_value_heads=len(tp.kv_heads(config)),
        intermediate_size=len(tp.intermediate(config)),
        moe_intermediate_size=len(tp.moe_intermediate(config)),
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // tp.size,
        head_dim=config.head_size,
    )


# A checkpoint tensor's place in one rank's model: (our parameter, its rows (an expert's
# rows of a stacked parameter: (expert, rows)), the checkpoint tensor's rows, its columns).
# Each layer lists its own (`layers/`); the loader copies them.
ShardEntry = tuple[str, slice | tuple[int, slice], slice, slice]
WHOLE = slice(None)


def span(r: range, width: int) -> slice:
    """Rows r.start * width .. r.stop * width: the rows of heads (width: head_dim)."""
    return slice(r.start * width, r.stop * width)


def init_tp_group(
    rank: int, size: int, store_addr: tuple[str, int], backend: str, timeout_s: float
) -> TPRank:
    """Join the default process group through the TCP store at `store_addr` (its server
    runs in the process that started the ranks). A collective that waits longer than
    `timeout_s` for a peer (dead or hung) raises."""
    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = store_addr
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return TPRank(rank, size)


def tp_backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
