"""The host KV store through the offline API: a small device cache, a large host store."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from mpprefill.bench.runner import BenchConfig
from mpprefill.config import ServerArgs
from mpprefill.engine import PrefillEngine
from mpprefill.flags import add_flags, from_namespace
from tests.model.test_loader import deepseek_checkpoint
from tests.scheduling.test_engine import dense_last_logits

pytestmark = pytest.mark.timeout(300)
SYSTEM_LEN, NUM_SYSTEMS = 96, 6
ENGINE_KW = dict(
    page_size=16,
    chunked_prefill_size=64,
    max_total_tokens=256,  # holds about two of the six system prompts
    check_invariants=True,
    # NOTE: one torch thread: two test workers share the cores, and a forward whose
    # threads wait for a busy core runs many times slower
    worker_threads=1,
)


def revisiting_prompts(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Two passes over the same system prompts, with fresh questions each time."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 4096) for _ in range(SYSTEM_LEN)] for _ in range(NUM_SYSTEMS)]

    def one_pass() -> list[list[int]]:
        return [s + [rng.randrange(1, 4096) for _ in range(rng.randrange(5, 20))] for s in systems]

    return one_pass(), one_pass()


def run_two_passes(mode: str, **kw):
    first, second = revisiting_prompts()
    with PrefillEngine(forward_mode=mode, **ENGINE_KW, **kw) as eng:
        s = eng.scheduler
        eng.prefill(first, return_logits=True)
        if s.host_tier is not None:
            s.host_tier.retire(wait=True)  # every write-back of pass one is matchable now
        outs = eng.prefill(second, return_logits=True)
        if s.host_tier is not None:
            s.host_tier.retire(wait=True)
            assert s.host_tier.store.writes_in_flight == 0
        eng.check_invariants(flush=True)
        return second, outs, s.metrics, s.host_tier


def recomputed_second_pass(**kw):
    """The second pass's outputs with no prefix cache: every prompt computed whole (a first
    pass would leave nothing behind to change them)."""
    _, second = revisiting_prompts()
    with PrefillEngine(forward_mode="normal", **ENGINE_KW, disable_radix_cache=True, **kw) as eng:
        outs = eng.prefill(second, return_logits=True)
        eng.check_invariants(flush=True)
        return outs


@pytest.fixture(scope="module")
def no_host_store():
    return run_two_passes("normal")


@pytest.mark.parametrize("mode", ["normal", "overlap", "thread-ahead", "proc-ahead"])
def test_revisited_prefixes_load_from_the_host_and_match_no_cache(mode, no_host_store):
    prompts, outs, metrics, tier = run_two_passes(mode, host_store_size=4096)
    assert metrics.host_loaded_tokens > 0 and metrics.host_written_tokens > 0
    cached = [o.cached_tokens for o in outs]
    assert cached == [SYSTEM_LEN] * NUM_SYSTEMS  # all from the host: the device lost them
    assert sum(cached) > sum(o.cached_tokens for o in no_host_store[1])
    for p, o in zip(prompts, outs):
        ref = dense_last_logits(p)
        torch.testing.assert_close(o.logits, ref, atol=2e-4, rtol=1e-4)
        assert o.first_token == int(ref.argmax())
    tier.check()


def test_bfloat16_host_tier_holds_the_pools_dtype():
    """A bfloat16 pool in the forward process's segment: the host tier's pages are bfloat16
    and the revisited prefixes load from it as in float32."""
    _, outs, metrics, tier = run_two_passes("proc-ahead", host_store_size=4096, dtype="bfloat16")
    assert tier.store.kv.dtype == torch.bfloat16
    assert metrics.host_loaded_tokens > 0 and metrics.host_written_tokens > 0
    assert [o.cached_tokens for o in outs] == [SYSTEM_LEN] * NUM_SYSTEMS
    recomputed = recomputed_second_pass(dtype="bfloat16")
    for o, r in zip(outs, recomputed, strict=True):
        # the same bfloat16 model over KV that took the host round trip or was recomputed
        torch.testing.assert_close(o.logits, r.logits, atol=5e-2, rtol=0)
    tier.check()


def host_bytes(tier) -> tuple[dict, torch.Tensor]:
    """The index as {token chain: host page} and the held slots' bytes, in page order."""
    entries = sorted(tier.store.index.entries(), key=lambda e: e.page)
    chains = {}
    for e in entries:
        chain, node = [], e
        while node is not tier.store.index.root:
            chain.append(node.tokens)
            node = node.parent
        chains[tuple(reversed(chain))] = e.page
    return chains, tier.store.kv.gather(tier.store.slots_of(entries)).view(torch.uint8)


def test_batched_and_per_request_writeback_store_the_same_bytes():
    _, _, _, batched = run_two_passes("normal", host_store_size=4096)
    _, _, _, single = run_two_passes("normal", host_store_size=4096, disable_batched_writeback=True)
    chains_b, bytes_b = host_bytes(batched)
    chains_s, bytes_s = host_bytes(single)
    assert chains_b == chains_s and torch.equal(bytes_b, bytes_s)
    assert len(batched.staging_log) < len(single.staging_log)


def test_host_store_is_off_by_default_and_flags_are_checked():
    with PrefillEngine(forward_mode="normal", max_total_tokens=256) as eng:
        assert eng.scheduler.host_tier is None
        eng.prefill([[1, 2, 3]])
        eng.check_invariants()
    with pytest.raises(ValueError, match="host-store-size"):
        ServerArgs(host_store_size=-1)
    with pytest.raises(ValueError, match="host-store-size"):
        ServerArgs(host_store_size=8, page_size=16)
    ap = argparse.ArgumentParser()
    add_flags(ap, ServerArgs)
    ns = ap.parse_args(["--host-store-size", "4096", "--disable-batched-staging"])
    args = from_namespace(ServerArgs, ns)
    assert args.host_store_size == 4096 and args.disable_batched_writeback  # old name, alias


def test_bench_passes_the_host_store_flags_to_the_server():
    plain = BenchConfig(ServerArgs(), ["proc-ahead"]).server_flags("proc-ahead", None)
    assert "--host-store-size" not in plain and "--disable-batched-writeback" not in plain
    server = ServerArgs(host_store_size=262144, disable_batched_writeback=True)
    flags = BenchConfig(server, ["proc-ahead"]).server_flags("proc-ahead", None)
    i = flags.index("--host-store-size")
    assert flags[i + 1] == "262144" and "--disable-batched-writeback" in flags


def test_flush_cache_drops_the_device_cache_and_the_host_tier():
    first, _ = revisiting_prompts()
    with PrefillEngine(forward_mode="proc-ahead", host_store_size=4096, **ENGINE_KW) as eng:
        s = eng.scheduler
        eng.prefill(first)
        flushed = eng.flush_cache()  # the last write-backs may still be in flight
        assert flushed.device > 0 and flushed.host >= NUM_SYSTEMS * SYSTEM_LEN
        assert len(s.host_tier.store.index) == 0 and s.tree.total_size() == 0
        loaded = s.metrics.host_loaded_tokens
        outs = eng.prefill(first)
        assert [o.cached_tokens for o in outs] == [0] * NUM_SYSTEMS
        assert s.metrics.host_loaded_tokens == loaded  # nothing left on the host to load
        eng.check_invariants(flush=True)


def test_the_servers_flush_cache_reply_counts_each_tier():
    from tests.reliability.helpers import Serve

    serve = Serve.start(
        *("--forward-mode", "normal", "--host-store-size", "4096"),
        *("--max-total-tokens", "256", "--log-level", "warning"),
    )
    client = serve.client()
    try:
        first, _ = revisiting_prompts()
        for i, ids in enumerate(first):
            client.generate(f"f{i}", ids)
        client.recv_until({f"f{i}" for i in range(len(first))})
        client.send({"type": "flush_cache", "rid": "flush"})
        reply = client.recv()
        assert reply["status"] == "flush_cache" and reply["success"], reply
        tokens = reply["flushed_tokens"]
        assert tokens["device"] > 0 and tokens["host"] >= NUM_SYSTEMS * SYSTEM_LEN, reply
        assert f"{tokens['host']} on the host" in reply["message"]
        client.generate("again", first[0])
        assert client.recv_until({"again"})["again"]["cached_tokens"] == 0
    finally:
        client.close()
        serve.kill()


def test_on_the_emulated_accelerator_host_hits_take_the_host_links_time():
    """The same revisits on `--device emulated`: the loads and write-backs each wait out
    the emulated model's KV over PCIe, and first tokens still equal the run without. (The
    host tier and its link live in the scheduler's process in every mode: one mode here.)"""
    mode = "normal"
    emulated = dict(device="emulated", emulate_model="Qwen2.5-0.5B")
    _, plain, _, _ = run_two_passes(mode, **emulated)
    _, outs, metrics, tier = run_two_passes(mode, host_store_size=4096, **emulated)
    assert [o.cached_tokens for o in outs] == [SYSTEM_LEN] * NUM_SYSTEMS
    assert [o.first_token for o in outs] == [o.first_token for o in plain]
    link = tier.store.copier.link
    moved = metrics.host_loaded_tokens + metrics.host_written_tokens
    assert metrics.host_loaded_tokens > 0
    # each token's K and V in 24 layers of 2 x 64 BF16 over 80% of 64 GB/s, at the least
    assert link.busy_s >= moved * 24 * 2 * 2 * 64 * 2 / 51.2e9


def test_a_latent_pool_goes_through_the_host_tier(tmp_path):
    """DeepSeek-V3's latent pool (one row a token and layer, no V) is written back and
    loaded like a K/V pool: every revisited prefix comes from the host, and the logits are
    those of the same prompts recomputed without a cache."""
    path, _, _ = deepseek_checkpoint(tmp_path, extra_layer=False)
    _, outs, metrics, tier = run_two_passes("normal", model_path=path, host_store_size=4096)
    assert tier.store.kv.latent and tier.store.kv.buffer.shape[0] == 1
    assert metrics.host_loaded_tokens > 0 and metrics.host_written_tokens > 0
    assert [o.cached_tokens for o in outs] == [SYSTEM_LEN] * NUM_SYSTEMS
    recomputed = recomputed_second_pass(model_path=path)
    for o, r in zip(outs, recomputed, strict=True):
        torch.testing.assert_close(o.logits, r.logits, atol=2e-4, rtol=1e-4)
        assert o.first_token == r.first_token
    tier.check()
