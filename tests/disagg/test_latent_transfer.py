"""DeepSeek-V3's latent KV pool through the transfer and the decode server, from a small
random checkpoint transformers wrote (2 layers, latent rows of 32 + 8, float32): the pool as
one plane per layer and the layout each side names; a decode refusing a prefill whose pool
keeps another layout, naming both; `--verify` comparing latent rows; and `mpprefill serve`
(proc-ahead, shm) feeding `mpprefill decode --model-path --verify`, whose greedy completions
equal transformers' `generate`."""

from __future__ import annotations

import random

import pytest
import torch

import mpprefill.protocol as protocol
from ipc.codec import MessageError
from mpprefill.bench.procs import free_port
from mpprefill.decode.verify import compare_kv
from mpprefill.disagg import wire
from mpprefill.disagg.page_writes import PageWrites
from mpprefill.disagg.rank_pools import ShippedKV
from mpprefill.disagg.transfer_sender import TransferCmd
from mpprefill.memory.allocator import PagedTokenAllocator, cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, load_model
from mpprefill.model.families import config_from_hf
from mpprefill.server.client import Client
from tests.disagg.helpers import PAGE, DecodeProc, Router
from tests.disagg.test_generate import hf_greedy
from tests.model.test_deepseek_v3 import DIMS, LATENT_DIM, YARN, deepseek
from tests.model.test_hf_oracle import save
from tests.reliability.helpers import Serve

HOST = "127.0.0.1"
LAYERS = 2
CHANGES = dict(num_hidden_layers=LAYERS, q_lora_rank=48, rope_parameters=YARN)
PROMPT_LENS = (40, 9, 23)  # 40: three pages, over two prefill chunks of 32
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple:
    """(transformers' model, its checkpoint directory)."""
    reference = deepseek(**CHANGES)
    path = save(reference, tmp_path_factory.mktemp("deepseek"))
    reference.generation_config.eos_token_id = None  # whole runs are compared
    return reference, path


def latent_config():
    return config_from_hf({**DIMS, **CHANGES, "architectures": ["DeepseekV3ForCausalLM"]})


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(DIMS["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


# ---- the pool on the wire --------------------------------------------------------------


def test_a_latent_pool_ships_one_plane_per_layer():
    config = latent_config()
    kv = KVCache.for_model(config, 16 * PAGE)
    # NOTE: the worker names the model's heads; the pool's one row serves them all
    shipped = ShippedKV.of([(kv, range(config.num_key_value_heads))])
    assert shipped.kv_heads == [[0, 1]]
    pages = PageWrites(shipped, PAGE)
    layout = pages.layout
    assert layout == wire.PoolLayout("float32", LAYERS, 16 * PAGE, 1, LATENT_DIM, PAGE, "latent")
    assert wire.PoolLayout.from_dict(layout.to_dict()) == layout
    assert pages.bootstrap(9) == wire.Bootstrap(9, 1, [[0, 1]], "float32", "latent", LATENT_DIM)
    src = torch.tensor([5, 2])
    cmd = TransferCmd("send", None, src, torch.tensor([0, 1]))
    [(_, _, planes)] = pages.writes(cmd)
    assert planes.dst_planes.tolist() == [0, 1]  # layer j's rows land on the decode's plane j
    assert planes.view.shape == (LAYERS, 16, PAGE * LATENT_DIM)
    rows = torch.randn(PAGE, LATENT_DIM)
    kv.write_latent(1, torch.arange(5 * PAGE, 6 * PAGE), rows)
    assert torch.equal(planes.view[1, 5].view(PAGE, LATENT_DIM), rows)
    assert planes.view.data_ptr() == kv.buffer.data_ptr()  # a view, nothing copied
    [(_, _, layer1)] = pages.layer_writes(cmd, 1)  # a layer-wise send's layer 1 alone
    assert layer1.dst_planes.tolist() == [1] and layer1.view.shape == (1, 16, PAGE * LATENT_DIM)
    assert torch.equal(layer1.view[0, 5].view(PAGE, LATENT_DIM), rows)


def test_at_two_ranks_the_first_ranks_latent_pool_ships_alone():
    """Each rank holds the whole latent row of every token: rank 0's pool is the one read,
    and the bootstrap names the prefill's two ranks and the one "head" they fill."""
    config = latent_config()
    pools = [KVCache.for_model(config, 16 * PAGE) for _ in range(2)]
    heads = [range(0, 2), range(2, 4)]  # each rank's query heads, as the worker names them
    shipped = ShippedKV.of(list(zip(pools, heads, strict=True)))
    assert shipped.tp_size == 2 and shipped.kv_heads == [[0, 1]]
    assert [s.kv for s in shipped.shards] == [pools[0]]
    pages = PageWrites(shipped, PAGE)
    assert pages.bootstrap(4) == wire.Bootstrap(4, 2, [[0, 1]], "float32", "latent", LATENT_DIM)
    assert wire.head_tiling_error([[0, 1]], 1, 2) is None


def test_the_prefill_checks_the_decode_pool_layout():
    pages = PageWrites(ShippedKV.of(KVCache.for_model(latent_config(), 16 * PAGE)), PAGE)
    reply = wire.BootstrapReply(9, "ready", {}, [3], 0, instance="run-1")
    assert pages.check_reply(reply, pages.layout).tolist() == [3]
    heads = wire.PoolLayout("float32", LAYERS, 16 * PAGE, 4, 8, PAGE)
    with pytest.raises(ValueError, match=r"differ in \['num_kv_heads', 'head_dim', 'kv_layout'\]"):
        pages.check_reply(reply, heads)
    with pytest.raises(MessageError, match="kv_layout"):
        wire.PoolLayout.from_dict({**pages.layout.to_dict(), "kv_layout": "rows"})


def test_the_decode_refuses_another_layout_naming_both():
    latent = wire.PoolLayout("float32", LAYERS, 64, 1, LATENT_DIM, PAGE, "latent")
    heads = wire.PoolLayout("float32", LAYERS, 64, 2, 16, PAGE)
    assert wire.layout_error("latent", LATENT_DIM, latent) is None
    assert wire.layout_error("heads", 16, heads) is None
    assert wire.layout_error("heads", 0, heads) is None  # a prefill of before names none
    assert wire.layout_error("latent", LATENT_DIM, heads) == (
        "the prefill's KV pool keeps latent rows of 40, this decode's K and V of 2 heads x 16"
        " (per token and layer): give both the same model"
    )
    assert "K and V of 16 per head, this decode's latent rows of 40" in wire.layout_error(
        "heads", 16, latent
    )
    assert "K and V per head, this decode's" in wire.layout_error("heads", 0, latent)
    assert "latent rows of 24, this decode's latent rows of 40" in wire.layout_error(
        "latent", 24, latent
    )
    frame = b'{"type":"bootstrap","room":7,"kv_layout":"latent","kv_dim":40}'
    assert wire.decode(frame) == wire.Bootstrap(7, kv_layout="latent", kv_dim=40)
    with pytest.raises(MessageError, match="kv_layout"):
        wire.decode(b'{"type":"bootstrap","room":7,"kv_layout":"rows"}')


# ---- --verify -----------------------------------------------------------------------


def test_verify_compares_the_latent_rows(checkpoint):
    """Rows a prefill wrote in two chunks on scattered pages pass; one changed row fails."""
    _, path = checkpoint
    model = load_model(path)
    ids = prompts(1)[0]
    kv = KVCache.for_model(model.config, 8 * PAGE)
    alloc = PagedTokenAllocator(8, PAGE)
    alloc.alloc_pages(3)  # page ids != prompt order
    pages = alloc.alloc_pages(cdiv(len(ids), PAGE)).flip(0)
    slots = alloc.slots_of(pages)[: len(ids)]
    for start, end in ((0, 32), (32, len(ids))):
        fb = ForwardBatch.build([ids[start:end]], [start], [slots[:end].tolist()])
        model(fb, kv)
    received = kv.gather(slots)
    assert received.shape == (1, LAYERS, len(ids), 1, LATENT_DIM)
    ok, err = compare_kv(model, ids, PAGE, 0, received)
    assert ok and err < 1e-4, err
    received[0, 1, 3, 0, LATENT_DIM - 1] += 0.01  # a rope dim of the fourth token's row
    ok, err = compare_kv(model, ids, PAGE, 0, received)
    assert not ok and err > 5e-3, err
    assert compare_kv(model, ids, PAGE, PAGE, received)[0]  # the decode's own prefix: unread


# ---- serve and decode ------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_serve_and_decode_generate_as_transformers(checkpoint):
    """The prefill's first token and the decode's steps over the latent rows that arrived
    (sent layer by layer, checked by --verify, else the request fails) equal transformers'
    greedy run; a K/V bootstrap at that decode is refused, both layouts named."""
    reference, path = checkpoint
    port = free_port()
    decode = DecodeProc("--model-path", path, "--verify")
    prefill = p = d = None
    try:
        prefill = Serve.start(
            *("--model-path", path, "--forward-mode", "proc-ahead", "--worker-threads", "1"),
            *("--disaggregation-transfer-backend", "shm", "--page-size", str(PAGE)),
            *("--disaggregation-bootstrap-port", str(port), "--chunked-prefill-size", "32"),
            *("--log-level", "warning", "--disaggregation-layerwise-send"),
        )
        decode.wait_ready(60)
        p = prefill.client()
        d = Client(f"{HOST}:{decode.zmq_port}")
        params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        ps = prompts()
        for i, ids in enumerate(ps):
            d.send_raw(protocol.generate_frame(f"g{i}", ids, params, 50 + i, HOST, port))
            p.send_raw(protocol.generate_frame(f"g{i}", ids, {"temperature": 0.0}, 50 + i))
        rids = {f"g{i}" for i in range(len(ps))}
        at_decode = d.recv_until(rids, timeout=90)
        at_prefill = p.recv_until(rids, timeout=30)
        with Router(decode.address) as router, Router(decode.address) as other:
            router.register("kv", 99, [1, 2, 3])
            router.sync()
            other.send({"type": "bootstrap", "room": 99, "kv_layout": "heads", "kv_dim": 8})
            refused = other.recv()
    finally:
        for c in (p, d):
            if c is not None:
                c.close()
        left = decode.close()
        if prefill is not None:
            prefill.kill()
    for i, ids in enumerate(ps):
        done = at_decode[f"g{i}"]
        assert done["status"] == "done", done
        assert done["output_ids"] == hf_greedy(reference, ids, NEW_TOKENS), f"prompt of {len(ids)}"
        assert at_prefill[f"g{i}"]["first_token"] == done["output_ids"][0], at_prefill[f"g{i}"]
    assert refused["status"] == "error", refused
    assert "K and V of 8 per head, this decode's latent rows of 40" in refused["error"]
    assert not left
