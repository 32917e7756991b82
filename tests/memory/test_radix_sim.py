"""The cache driven the way the scheduler drives it: admit, chunk, cache, release."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpprefill.memory.allocator import PagedTokenAllocator
from mpprefill.memory.radix_cache import RadixCache, TreeNode
from mpprefill.memory.req_to_token import ReqToTokenPool


@dataclass
class SimReq:
    origin_input_ids: list[int]
    req_pool_idx: int
    fill_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: TreeNode
    cache_protected_len: int
    prefill_done: bool = False


@dataclass
class Sim:
    page_size: int
    num_pages: int
    chunk: int
    rows: int = 6
    disable: bool = False
    reqs: list[SimReq] = field(default_factory=list)
    locks: list[TreeNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.alloc = PagedTokenAllocator(self.num_pages, self.page_size)
        self.pool = ReqToTokenPool(self.rows, 256)
        self.cache = RadixCache(self.pool, self.alloc, self.page_size, self.disable)

    def row(self, req: SimReq) -> torch.Tensor:
        return self.pool.req_to_token[req.req_pool_idx]

    def admit(self, prompt: list[int]) -> SimReq | None:
        idx = self.pool.alloc()
        if idx is None:
            return None
        m = self.cache.match_prefix(prompt[:-1])  # at least one token must be computed
        self.cache.inc_lock_ref(m.last_node)
        self.pool.write(idx, 0, m.indices)
        n = len(m.indices)
        req = SimReq(prompt, idx, prompt[:n], m.indices, m.last_node, n)
        self.reqs.append(req)
        return req

    def step(self, req: SimReq) -> bool:
        """Run the next chunk; False when memory is short even after eviction."""
        p = len(req.prefix_indices)
        s = min(p + self.chunk, len(req.origin_input_ids))
        last = int(req.prefix_indices[-1]) if p else -1
        slots = self.alloc.alloc_extend([p], [s], [last])
        if slots is None:
            self.cache.evict(self.alloc.pages_needed(p, s) * self.page_size)
            slots = self.alloc.alloc_extend([p], [s], [last])
            if slots is None:
                return False
        self.pool.write(req.req_pool_idx, p, slots)
        req.fill_ids = req.origin_input_ids[:s]
        self.cache.cache_unfinished_req(req)  # the final chunk too: the lock is kept
        req.prefill_done = s == len(req.origin_input_ids)
        return True

    def release(self, req: SimReq) -> None:
        """Transfer ended (or the request was aborted): cache as finished, free the row."""
        self.cache.cache_finished_req(req)
        self.pool.free(req.req_pool_idx)
        self.reqs.remove(req)

    def drain(self) -> None:
        for req in list(self.reqs):
            self.release(req)
        for node in self.locks:
            self.cache.dec_lock_ref(node)
        self.locks.clear()
        check_all(self)
        assert self.cache.protected_size() == 0
        assert self.alloc.num_free_pages * self.page_size + self.cache.total_size() == (
            self.alloc.size
        )
        self.cache.flush()
        assert self.alloc.num_free_pages == self.num_pages
        assert self.pool.available_size() == self.rows


def tree_nodes(cache: RadixCache) -> list[TreeNode]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def path_slots(cache: RadixCache, node: TreeNode) -> list[int]:
    parts = []
    while node is not cache.root:
        parts.append(node.value.tolist())
        node = node.parent
    return [s for part in reversed(parts) for s in part]


def check_locks(sim: Sim) -> None:
    expected: dict[int, int] = {}
    for node in [r.last_node for r in sim.reqs] + sim.locks:
        while node is not sim.cache.root:
            expected[node.id] = expected.get(node.id, 0) + 1
            node = node.parent
    for node in tree_nodes(sim.cache):
        assert node.lock_ref == expected.pop(node.id, 0), node
    assert not expected, "a lock holder's node left the tree"


def check_req(sim: Sim, req: SimReq) -> list[int]:
    """Per-request invariants; returns the pages the request owns."""
    ps, row = sim.page_size, sim.row(req)
    kv_len, protected = len(req.fill_ids), req.cache_protected_len
    assert req.fill_ids == req.origin_input_ids[:kv_len]
    assert row[: len(req.prefix_indices)].tolist() == req.prefix_indices.tolist()
    assert path_slots(sim.cache, req.last_node) == row[:protected].tolist()
    assert (row[:kv_len] % ps == torch.arange(kv_len) % ps).all()
    return sorted(set((row[protected:kv_len] // ps).tolist()))


def check_all(sim: Sim) -> None:
    sim.alloc.check()
    sim.pool.check()
    sim.cache.check()
    check_locks(sim)
    tree = [
        int(s) // sim.page_size for n in tree_nodes(sim.cache) for s in n.value[:: sim.page_size]
    ]
    owned = [p for req in sim.reqs for p in check_req(sim, req)]
    free = sim.alloc.free_pages().tolist()
    assert sorted(tree + owned + free) == list(range(sim.num_pages)), "pages not partitioned"
    assert sim.pool.available_size() == sim.rows - len(sim.reqs)


def run_to_completion(sim: Sim, req: SimReq) -> None:
    while not req.prefill_done:
        assert sim.step(req)
        check_all(sim)


def test_chunked_request_then_a_hit():
    sim = Sim(page_size=16, num_pages=16, chunk=32)
    prompt = [7] * 40 + list(range(30))
    a = sim.admit(prompt)
    expected = [(32, 32, 2), (64, 64, 4), (64, 70, 5)]  # protected, prefix, held pages
    for protected, prefix, held in expected:
        assert sim.step(a)
        check_all(sim)
        assert (a.cache_protected_len, len(a.prefix_indices)) == (protected, prefix)
        assert sim.num_pages - sim.alloc.num_free_pages == held
    b = sim.admit(prompt)
    assert b.cache_protected_len == 64 and sim.cache.protected_size() == 64
    run_to_completion(sim, b)
    sim.release(a)
    check_all(sim)
    assert sim.num_pages - sim.alloc.num_free_pages == 5  # 4 cached + b's tail page
    sim.release(b)
    sim.drain()


def test_concurrent_duplicates_are_freed_and_rows_rewritten():
    sim = Sim(page_size=4, num_pages=32, chunk=8)
    prompt = list(range(22))
    a, b = sim.admit(prompt), sim.admit(prompt)
    assert sim.step(a) and sim.step(b)
    check_all(sim)
    assert b.prefix_indices.tolist() == a.prefix_indices.tolist()
    assert sim.num_pages - sim.alloc.num_free_pages == 2  # b's copies went back
    run_to_completion(sim, b)
    run_to_completion(sim, a)
    assert sim.row(a)[:20].tolist() == sim.row(b)[:20].tolist()
    sim.drain()


@pytest.mark.parametrize("disable", [False, True])
def test_abort_mid_prefill_returns_everything(disable):
    sim = Sim(page_size=4, num_pages=32, chunk=6, disable=disable)
    a = sim.admit(list(range(30)))
    assert sim.step(a) and sim.step(a)
    sim.release(a)
    check_all(sim)
    assert sim.cache.total_size() == (0 if disable else 12)
    sim.drain()


BASES = [[(g * 31 + i * 7) % 11 for i in range(96)] for g in range(3)]

prompt_st = st.builds(
    lambda g, k, tail: (BASES[g][:k] + tail) or [1],
    st.integers(0, 2),
    st.sampled_from([0, 5, 16, 31, 32, 48, 64]),
    st.lists(st.integers(0, 3), max_size=24),
)
OPS = ["admit"] * 3 + ["step"] * 4 + ["run"] * 2 + ["release"] * 2
OPS += ["lock", "unlock", "insert", "evict", "flush"]
op_st = st.tuples(st.sampled_from(OPS), st.integers(0, 64), prompt_st)


def apply(sim: Sim, op: str, n: int, prompt: list[int]) -> None:
    if op == "admit":
        sim.admit(prompt)
    elif op in ("step", "run") and sim.reqs:
        req = sim.reqs[n % len(sim.reqs)]
        while not req.prefill_done and sim.step(req) and op == "run":
            check_all(sim)
    elif op == "release" and sim.reqs:
        sim.release(sim.reqs[n % len(sim.reqs)])
    elif op == "unlock" and sim.locks:
        sim.cache.dec_lock_ref(sim.locks.pop(n % len(sim.locks)))
    elif op == "lock":
        sim.locks.append(sim.cache.match_prefix(prompt).last_node)
        sim.cache.inc_lock_ref(sim.locks[-1])
    elif op == "insert":
        slots = sim.alloc.alloc_extend([0], [len(prompt)], [-1])
        if slots is not None:
            present = sim.cache.insert(prompt, slots)
            aligned = len(prompt) - len(prompt) % sim.page_size
            sim.alloc.free(torch.cat([slots[:present], slots[aligned:]]))
    elif op == "evict":
        sim.cache.evict(n)
    elif op == "flush" and sim.cache.protected_size() == 0:
        sim.cache.flush()


@pytest.mark.parametrize(
    ("page_size", "num_pages", "chunk", "disable"),
    [(1, 96, 13, False), (4, 24, 8, False), (16, 7, 24, False), (16, 7, 32, True)],
)
@settings(max_examples=80, deadline=None)
@given(ops=st.lists(op_st, min_size=20, max_size=60), chunk_bump=st.integers(0, 1))
def test_random_operations_keep_invariants(page_size, num_pages, chunk, disable, ops, chunk_bump):
    sim = Sim(page_size, num_pages, chunk + chunk_bump * page_size, disable=disable)
    for op in ops:
        apply(sim, *op)
        check_all(sim)
    sim.drain()
