"""Batched prefill attention behind one seam: a backend plans a batch once per forward, on
the host, from the batch's host lengths, then runs every layer's attention over the whole
batch in a number of calls that does not grow with the number of requests.

    plan = backend.plan(fb, kv_indices, window)             # once per forward (and per pool)
    out = backend.attend(q, k_pool, v_pool, plan, sinks)    # once per layer

Request r of a batch has p_r prefix tokens, e_r new tokens (its queries, at positions
p_r .. p_r + e_r - 1) and, in `kv_indices`, the slots of its p_r + e_r keys. A layer with
a sliding window W reads only keys from f_r = max(0, p_r - W + 1) on (older ones may be
gone from its pool), so k_r = p_r + e_r - f_r keys. Query i of r sees key j (position
f_r + j) when f_r + j <= p_r + i, and, with a window, f_r + j > p_r + i - W.

Backends (`--attention-backend`):
- torch_native: torch's scaled_dot_product_attention over padded groups of requests
  (any device; the CPU's path). Requests of alike shapes share a group, padded to its
  longest queries and keys and masked.
- torch_varlen: torch's flash-attention varlen kernel over the packed batch (CUDA, 16-bit
  dtypes): one call a layer, no padding, the causal mask aligned to each request's end.

Attention sinks (gpt-oss): one learned logit s_h per query head joins every softmax
denominator of head h, with no value. With O and L the attention output and log-sum-exp of a
query without the sink, the output with it is O * e^L / (e^L + e^s) = O * sigmoid(L - s_h),
so a backend that returns L corrects its output with one elementwise product, whatever the
batch.

Nothing here reads a device tensor back: index tensors are built on the host with torch's
CPU ops from the host lengths and copied to the device without a wait.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from mpprefill.model.forward_batch import ForwardBatch

BACKENDS = ("torch_native", "torch_varlen")
# A request joins a group while the group's padded attention area stays within this factor
# of the exact one (sum of e_r * k_r over its requests).
MAX_PADDING = 1.25


class Lengths(NamedTuple):
    """Per-request host lengths of one pool's view of a batch (see the module doc)."""

    prefix: list[int]
    extend: list[int]
    first_key: list[int]  # f_r
    keys: list[int]  # k_r
    query_start: list[int]  # row of r's first query in the batch's [T] rows
    key_start: list[int]  # index of r's key f_r in kv_indices

    @classmethod
    def of(cls, fb: ForwardBatch, window: int | None) -> Lengths:
        prefix, extend = list(fb.prefix_lens_cpu), list(fb.extend_lens_cpu)
        first = [0 if window is None else max(0, p - window + 1) for p in prefix]
        keys = [p + e - f for p, e, f in zip(prefix, extend, first)]
        query_start = _starts(extend)
        key_start = [s + f for s, f in zip(_starts([p + e for p, e in zip(prefix, extend)]), first)]
        return cls(prefix, extend, first, keys, query_start, key_start)


def _starts(lengths: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)][:-1]


def _host(values: Sequence[int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _ranges(starts: Sequence[int], lengths: Sequence[int]) -> Tensor:
    """start_0 .. start_0 + len_0 - 1 | start_1 .. | ... as one host tensor."""
    ends = list(itertools.accumulate(lengths))
    shift = [s - (end - n) for s, end, n in zip(starts, ends, lengths)]
    total = ends[-1] if ends else 0
    return torch.arange(total) + torch.repeat_interleave(_host(shift), _host(lengths))


def _upload(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device`, copied without waiting for the device."""
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


class AttentionBackend:
    name = ""

    def plan(self, fb: ForwardBatch, kv_indices: Tensor, window: int | None) -> Any:
        raise NotImplementedError

    def attend(
        self, q: Tensor, k_pool: Tensor, v_pool: Tensor, plan: Any, sinks: Tensor | None = None
    ) -> Tensor:
        """q [T, H, D] over the pool's keys [slots, H_kv, D] and values [slots, H_kv, D_v]:
        [T, H, D_v], softmax scale D^-0.5. `sinks` [H]: each head's sink logit (see the
        module doc)."""
        raise NotImplementedError


def sink_gate(lse: Tensor, sinks: Tensor) -> Tensor:
    """sigmoid(L - s_h) in float32, the factor a sink leaves on each output; `lse` holds
    the heads on its second to last dimension ([.., H, queries])."""
    return torch.sigmoid(lse.float() - sinks.float()[:, None])


class Group(NamedTuple):
    """Requests padded to E queries and K keys each, laid out request-major."""

    size: int  # n requests
    queries: int  # E
    keys: int  # K
    query_rows: Tensor  # [n * E] rows of q (a request's padding repeats its last query)
    key_slots: Tensor  # [n * K] pool slots (padding repeats the request's last key)
    mask: Tensor | None  # [n, 1, E, K] bool: which keys each query sees; None: all
    causal: bool  # no mask: plain causal (every request p = 0, e = k = E = K)


class NativePlan(NamedTuple):
    groups: list[Group]
    out_rows: Tensor | None  # [T] row of each query in the groups' stacked outputs


class TorchNative(AttentionBackend):
    """scaled_dot_product_attention over padded groups: calls a layer grow with the
    number of distinct request shapes, not with the number of requests."""

    name = "torch_native"

    def plan(self, fb: ForwardBatch, kv_indices: Tensor, window: int | None) -> NativePlan:
        lens = Lengths.of(fb, window)
        device = kv_indices.device
        members = group_requests(lens.extend, lens.keys)
        groups, src_start, base = [], [0] * len(lens.extend), 0
        for reqs in members:
            groups.append(_group(lens, reqs, kv_indices, window, device))
            width = max(lens.extend[r] for r in reqs)
            for i, r in enumerate(reqs):
                src_start[r] = base + i * width
            base += len(reqs) * width
        if base == sum(lens.extend) and src_start == lens.query_start:
            return NativePlan(groups, None)  # one unpadded group, in batch order
        return NativePlan(groups, _upload(_ranges(src_start, lens.extend), device))

    def attend(
        self,
        q: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        plan: NativePlan,
        sinks: Tensor | None = None,
    ) -> Tensor:
        outs = [_attend_group(q, k_pool, v_pool, g, sinks) for g in plan.groups]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if plan.out_rows is None else out.index_select(0, plan.out_rows)


def _attend_group(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, g: Group, sinks: Tensor | None
) -> Tensor:
    n, e, k = g.size, g.queries, g.keys
    heads, dim = q.shape[1], q.shape[2]
    # NOTE: 4-D [n, heads, len, dim] inputs; 3-D ones take the slow math kernel on the CPU.
    qg = q.index_select(0, g.query_rows).view(n, e, heads, dim).transpose(1, 2)
    kg = _keys(k_pool, g.key_slots, n, k, q.dtype)
    vg = _keys(v_pool, g.key_slots, n, k, q.dtype)
    if sinks is None:
        out = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=g.mask, is_causal=g.causal, enable_gqa=True
        )
    else:
        out, lse = attention_with_lse(qg, kg, vg, g.mask, g.causal)
        out = out * sink_gate(lse, sinks).unsqueeze(-1).to(out.dtype)
    return out.transpose(1, 2).reshape(n * e, heads, vg.shape[-1])


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool
) -> tuple[Tensor, Tensor]:
    """Attention of q [n, H, E, D] over k, v [n, H_kv, K, D] and its log-sum-exp [n, H, E]
    (float32): torch's flash kernel on the CPU, the scores written out elsewhere."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # neither form takes GQA: each KV head repeated for its query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if q.device.type == "cpu":
        if mask is not None:  # the kernel takes an additive mask of q's dtype only
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return flash(q, k, v, 0.0, causal, attn_mask=mask)
    return _math_with_lse(q, k, v, mask, causal)


def _math_with_lse(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool
) -> tuple[Tensor, Tensor]:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        e, kk = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(e, kk, dtype=torch.bool, device=q.device).tril_()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs.to(v.dtype), v), lse


def _keys(pool: Tensor, slots: Tensor, n: int, k: int, dtype: torch.dtype) -> Tensor:
    t = pool.index_select(0, slots)
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.view(n, k, pool.shape[1], pool.shape[2]).transpose(1, 2)


def group_requests(extend: Sequence[int], keys: Sequence[int]) -> list[list[int]]:
    """Requests in groups whose padded area (n * max e * max k) stays within MAX_PADDING of
    the exact one; requests sorted by keys, then new tokens, each group in batch order."""
    order = sorted(range(len(extend)), key=lambda r: (keys[r], extend[r]), reverse=True)
    groups: list[list[int]] = []
    cur: list[int] = []
    exact = max_e = max_k = 0
    for r in order:
        e, k = max(max_e, extend[r]), max(max_k, keys[r])
        area = exact + extend[r] * keys[r]
        if cur and (len(cur) + 1) * e * k > MAX_PADDING * area:
            groups.append(sorted(cur))
            cur, exact, e, k, area = [], 0, extend[r], keys[r], extend[r] * keys[r]
        cur.append(r)
        exact, max_e, max_k = area, e, k
    if cur:
        groups.append(sorted(cur))
    return sorted(groups)


def _group(lens: Lengths, reqs: list[int], kv_indices: Tensor, window: int | None, device) -> Group:
    """One group's index tensors and mask, built on the host, copied to `device`."""
    pick = lambda xs: _host([xs[r] for r in reqs])  # noqa: E731
    e = max(lens.extend[r] for r in reqs)
    k = max(lens.keys[r] for r in reqs)
    query_rows = pick(lens.query_start)[:, None] + _clamped(e, pick(lens.extend))
    key_pos = pick(lens.key_start)[:, None] + _clamped(k, pick(lens.keys))
    key_slots = kv_indices.index_select(0, _upload(key_pos.reshape(-1), device))
    mask, causal = _mask(lens, reqs, e, k, window)
    mask = None if mask is None else _upload(mask, device)
    return Group(len(reqs), e, k, _upload(query_rows.reshape(-1), device), key_slots, mask, causal)


def _clamped(width: int, lengths: Tensor) -> Tensor:
    """[n, width]: 0, 1, .., length - 1, then length - 1 repeated (the padding)."""
    return torch.minimum(torch.arange(width)[None, :], lengths[:, None] - 1)


def _mask(lens: Lengths, reqs: list[int], e: int, k: int, window: int | None):
    """(mask [n, 1, E, K] or None, causal): None where every query sees every key (or
    plain causal does it)."""
    prefix = [lens.prefix[r] for r in reqs]
    extend = [lens.extend[r] for r in reqs]
    keys = [lens.keys[r] for r in reqs]
    if all(k_r == k for k_r in keys):
        if e == 1:
            return None, False  # one query each, at the end of its keys: it sees them all
        plain = all(p == 0 and x == e for p, x in zip(prefix, extend))
        if plain and (window is None or e <= window):
            return None, e > 1
    # [n, E] query positions; a padding query stands where its request's last one does
    positions = _host(prefix)[:, None] + _clamped(e, _host(extend))
    key_pos = _host([lens.first_key[r] for r in reqs])[:, None] + torch.arange(k)[None, :]
    sees = key_pos[:, None, :] <= positions[:, :, None]
    if window is not None:
        sees &= key_pos[:, None, :] > positions[:, :, None] - window
    sees &= torch.arange(k)[None, None, :] < _host(keys)[:, None, None]
    return sees[:, None], False


class VarlenPlan(NamedTuple):
    key_slots: Tensor  # [sum k_r] pool slots, request after request
    cu_queries: Tensor  # [B + 1] int32
    cu_keys: Tensor  # [B + 1] int32
    max_queries: int
    max_keys: int
    window: tuple[int, int]  # (left, right) as the kernel takes it


class TorchVarlen(AttentionBackend):
    """torch.nn.attention.varlen over the packed batch: its K/V gathered from the pool
    (one index_select each) then one kernel call. `kernel` (torch's varlen_attn unless
    given) takes (q, k, v, cu_q, cu_k, max_q, max_k, window_size=, enable_gqa=) and, with
    `return_aux=AuxRequest(lse=True)`, returns the log-sum-exp [H, T] beside the output."""

    name = "torch_varlen"

    def __init__(self, kernel=None) -> None:
        from torch.nn.attention.varlen import AuxRequest

        if kernel is None:
            from torch.nn.attention.varlen import varlen_attn as kernel
        self.kernel = kernel
        self.with_lse = AuxRequest(lse=True)

    def plan(self, fb: ForwardBatch, kv_indices: Tensor, window: int | None) -> VarlenPlan:
        lens = Lengths.of(fb, window)
        device = kv_indices.device
        key_slots = kv_indices
        if window is not None and any(lens.first_key):
            key_pos = _ranges(lens.key_start, lens.keys)
            key_slots = kv_indices.index_select(0, _upload(key_pos, device))
        cu = lambda xs: _upload(_host([0, *itertools.accumulate(xs)]).int(), device)  # noqa: E731
        # NOTE: the kernel aligns the causal diagonal to the end of each request's keys,
        # which is where its queries sit (p_r + e_r == f_r + k_r).
        left = -1 if window is None else window - 1
        return VarlenPlan(
            key_slots,
            cu(lens.extend),
            cu(lens.keys),
            max(lens.extend, default=0),
            max(lens.keys, default=0),
            (left, 0),
        )

    def attend(
        self,
        q: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        plan: VarlenPlan,
        sinks: Tensor | None = None,
    ) -> Tensor:
        k = k_pool.index_select(0, plan.key_slots)
        v = v_pool.index_select(0, plan.key_slots)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        v_dim = v.shape[-1]
        if v_dim != q.shape[-1]:
            v = _padded_values(v, q.shape[-1])
        args = (q, k, v, plan.cu_queries, plan.cu_keys, plan.max_queries, plan.max_keys)
        if sinks is None:
            out = self.kernel(*args, window_size=plan.window, enable_gqa=True)
        else:
            out, lse = self.kernel(
                *args, return_aux=self.with_lse, window_size=plan.window, enable_gqa=True
            )
            # NOTE: the varlen kernel's log-sum-exp is [H, T] (flash-attention's varlen layout).
            out = out * sink_gate(lse, sinks).t().unsqueeze(-1).to(out.dtype)
        return out if v_dim == q.shape[-1] else out[..., :v_dim]


def _padded_values(v: Tensor, dim: int) -> Tensor:
    """V [.., D_v] zero-padded to the queries' D (the varlen kernel takes one head dim; the
    padding's outputs are zero and cut off)."""
    if v.shape[-1] > dim:
        raise ValueError(f"values of {v.shape[-1]} dims wider than the queries' {dim}")
    return F.pad(v, (0, dim - v.shape[-1]))


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's flash varlen kernel runs here: CUDA, 16-bit, the module present."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def make_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """The backend `--attention-backend` names; auto: torch_varlen where it runs, else
    torch_native."""
    device = torch.device(device)
    if name == "auto":
        name = "torch_varlen" if varlen_available(device, dtype) else "torch_native"
    if name == "torch_native":
        return TorchNative()
    if name == "torch_varlen":
        if not varlen_available(device, dtype):
            raise ValueError(
                f"--attention-backend torch_varlen needs CUDA and float16/bfloat16, not"
                f" {device.type} {str(dtype).removeprefix('torch.')}"
            )
        return TorchVarlen()
    raise ValueError(f"--attention-backend: one of auto, {', '.join(BACKENDS)}; got {name!r}")
