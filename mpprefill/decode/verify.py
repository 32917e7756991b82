"""The decode receiver's `--verify`: recompute a prompt's KV densely and compare (a latent
model's latent rows, as its pool keeps them).

With sliding-window (SWA) layers the prefill sends their KV for the prompt's last window
only, as whole pages. So SWA layers are compared in that window, and each position before
the pages sent must still hold the NaN that a room's pages get when allocated (`poison`):
nothing else of those layers was written.

    position     prefix_len ......... lo .... L - W + 1 ......... L    lo: first page sent
    full layers  [ compared                                       ]
    SWA layers   [ NaN                ][ sent   ][ compared       ]
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mpprefill.disagg.plane_map import window_first_page
from mpprefill.memory.allocator import cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, ModelConfig, load_model

logger = logging.getLogger(__name__)


class KVVerifier:
    """The verify model, and a helper thread so the receiver's loop keeps answering pings."""

    def __init__(self, args, model=None, kv_dtype: torch.dtype | None = None) -> None:
        """`args`: DecodeArgs (model_path, random_seed, sliding_window, swa_layers, page_size,
        dtype); `model`: one loaded from them already (the decode server's), else loaded here;
        `kv_dtype`: the receive pool's (default: the model's), which the reference KV takes."""
        self.model = model or load_decode_model(args)
        self.page_size = args.page_size
        self.kv_dtype = kv_dtype
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-verify")

    def poison(self, kv: KVCache, slots: torch.Tensor) -> None:
        """Fill fresh receive slots with NaN in every layer: what is never sent stays NaN."""
        kv.buffer.index_fill_(2, slots.to(kv.device), float("nan"))

    def submit(self, input_ids: list[int], prefix_len: int, received: torch.Tensor) -> Future:
        args = (self.model, input_ids, self.page_size, prefix_len, received, self.kv_dtype)
        return self._pool.submit(compare_kv, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def load_decode_model(args):
    """The model of DecodeArgs `args`: the decode server generates with it, --verify
    recomputes KV with it."""
    return load_model(
        args.model_path,
        seed=args.random_seed,
        sliding_window=args.sliding_window,
        swa_layers=args.swa_layers,
        dtype=args.dtype,
    )


def reference_kv(
    model, input_ids: list[int], page_size: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """KV of one dense prefill of the whole prompt, in a pool of `dtype` (default: the
    model's): [2, L, len(input_ids), H, D], or a latent model's rows [1, L, n, 1, D]."""
    n = len(input_ids)
    kv = KVCache.for_model(model.config, cdiv(n, page_size) * page_size, dtype=dtype)
    model(ForwardBatch.build([input_ids], [0], [list(range(n))]), kv)
    if kv.latent:
        return kv.gather(torch.arange(n))
    dense = torch.empty(2, kv.num_layers, n, *kv.buffer.shape[3:], dtype=kv.dtype)
    for layer in range(kv.num_layers):
        dense[0, layer], dense[1, layer] = kv.k(layer)[:n], kv.v(layer)[:n]
    return dense


def compare_kv(
    model,
    input_ids: list[int],
    page_size: int,
    prefix_len: int,
    received: torch.Tensor,
    kv_dtype: torch.dtype | None = None,
) -> tuple[bool, float]:
    """(close enough, max abs error) of received KV [2, L, n, H, D] (latent rows
    [1, L, n, 1, D]) past `prefix_len`."""
    expected = reference_kv(model, input_ids, page_size, kv_dtype)
    return check_kv(model.config, expected, received, prefix_len, page_size)


def check_kv(
    config: ModelConfig,
    expected: torch.Tensor,
    received: torch.Tensor,
    prefix_len: int,
    page_size: int,
) -> tuple[bool, float]:
    """Full layers past `prefix_len`; SWA layers in the last window, NaN before it."""
    n, swa = expected.shape[2], list(KVCache.swa_layers_of(config))
    full = [i for i in range(config.num_hidden_layers) if i not in swa]
    # NOTE: a prefill's chunks and batches round differently from one dense pass below float32
    exact = expected.dtype == torch.float32 and config.torch_dtype == torch.float32
    atol = 1e-4 if exact else 2e-2
    ok, err = _close(received[:, full, prefix_len:], expected[:, full, prefix_len:], atol)
    if swa:
        window = max(prefix_len, n - config.sliding_window + 1)
        ok_w, err_w = _close(received[:, swa, window:], expected[:, swa, window:], atol)
        lo = max(prefix_len, window_first_page(n, config.sliding_window, page_size) * page_size)
        unsent = bool(received[:, swa, prefix_len:lo].isnan().all())
        if not unsent:
            logger.warning("SWA-layer KV before the last window was written")
        ok, err = ok and ok_w and unsent, max(err, err_w)
    return ok, err


def _close(got: torch.Tensor, want: torch.Tensor, atol: float) -> tuple[bool, float]:
    """allclose (NaN never is), and the largest finite error."""
    got, want = got.float(), want.float()
    err = float((got - want).abs().nan_to_num(0.0).max()) if got.numel() else 0.0
    return bool(torch.allclose(got, want, rtol=atol, atol=atol)), err
