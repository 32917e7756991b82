"""HostPageIndex: which token pages the host KV store holds, as exact page chains.

A page of a prompt is identified by its tokens and the entry of the page before it, so the
key of page i is (id of page i-1's entry, tokens of page i): the whole prefix up to page i,
with no hash collisions. A lookup walks a prompt page by page from the root and stops at the
first page the index lacks.

    prompt  | a a a a | b b b b | c c c c |
    key       (0, aaaa)  (e1, bbbb)  (e2, cccc)      e1, e2: ids of the entries found before

NOTE: only leaves are evicted (pages no other page chains from), so the index stays
prefix-closed: when page i is held, pages 0..i-1 of that prompt are held too.

With sliding-window layers an entry may also hold its page's SWA KV (`swa_page`): the
pages of a checkpoint, the window before a prefix end that a later match may stop at.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class HostPage:
    id: int
    parent: HostPage | None = field(repr=False)
    tokens: tuple[int, ...] = field(repr=False)
    page: int  # host page number; its slots are [page * page_size, (page + 1) * page_size)
    ready: bool = False  # its KV copy has been retired; until then it is a write in flight
    swa_page: int = -1  # host SWA page holding its sliding-window KV, -1: none
    swa_ready: bool = False  # that SWA copy has been retired
    children: int = 0
    last_access: int = 0


class HostPageIndex:
    """Entries by key, and a heap of (last_access, id) of eviction candidates.

    NOTE: the heap is lazy: an entry is pushed whenever it may have become an evictable leaf
    (added, touched as a leaf, made ready, or its last child gone); a record whose entry is
    gone, not an evictable leaf, or touched since is skipped when popped.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = HostPage(0, None, (), -1, ready=True)
        self._next_id = 0
        self._clock = 0
        self._entries: dict[tuple[int, tuple[int, ...]], HostPage] = {}
        self._heap: list[tuple[int, int, HostPage]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> Iterable[HostPage]:
        return self._entries.values()

    def walk(self, token_ids: Sequence[int], ready_only: bool) -> list[HostPage]:
        """Entries of the leading whole pages of token_ids that are held, marked used.

        ready_only stops at the first page whose copy is still in flight.
        """
        path, node, ps = [], self.root, self.page_size
        self._clock += 1
        for start in range(0, len(token_ids) - ps + 1, ps):
            child = self._entries.get((node.id, tuple(token_ids[start : start + ps])))
            if child is None or (ready_only and not child.ready):
                break
            child.last_access = self._clock
            path.append(child)
            node = child
        if path and not path[-1].children:
            self._push(path[-1])
        return path

    def add(self, parent: HostPage, tokens: Sequence[int], page: int) -> HostPage:
        """A new entry (not ready) for the page after `parent`."""
        self._next_id += 1
        entry = HostPage(self._next_id, parent, tuple(tokens), page, last_access=self._clock)
        key = (parent.id, entry.tokens)
        if key in self._entries:
            raise ValueError(f"host page {key[1][:4]}... after entry {parent.id} is held already")
        self._entries[key] = entry
        parent.children += 1
        return entry

    def set_ready(self, entry: HostPage) -> None:
        entry.ready = True
        if not entry.children:
            self._push(entry)

    def set_swa_ready(self, entry: HostPage) -> None:
        entry.swa_ready = True
        if not entry.children:
            self._push(entry)

    def evict(self, num_pages: int, keep: frozenset[int] = frozenset()) -> list[HostPage]:
        """Drop up to num_pages ready leaves, least recently used first; the entries dropped.

        Entries whose id is in `keep`, and writes in flight, are never dropped.
        """
        freed: list[HostPage] = []
        kept: list[HostPage] = []
        while len(freed) < num_pages and self._heap:
            access, _, entry = heapq.heappop(self._heap)
            if access != entry.last_access or not self._evictable(entry):
                continue
            if entry.id in keep:
                kept.append(entry)
                continue
            self._remove(entry)
            freed.append(entry)
            if entry.parent is not self.root and not entry.parent.children:
                self._push(entry.parent)
        for entry in kept:
            self._push(entry)
        return freed

    def _evictable(self, entry: HostPage) -> bool:
        key = (entry.parent.id, entry.tokens)
        written = entry.ready and (entry.swa_page < 0 or entry.swa_ready)
        return written and not entry.children and self._entries.get(key) is entry

    def _push(self, entry: HostPage) -> None:
        heapq.heappush(self._heap, (entry.last_access, entry.id, entry))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [(e.last_access, e.id, e) for e in self._entries.values()]
            heapq.heapify(self._heap)

    def clear(self) -> list[HostPage]:
        """Drop every entry, ready or not; the entries dropped."""
        dropped = list(self._entries.values())
        self._entries.clear()
        self._heap.clear()
        self.root.children = 0
        return dropped

    def _remove(self, entry: HostPage) -> None:
        del self._entries[(entry.parent.id, entry.tokens)]
        entry.parent.children -= 1

    def check(self) -> None:
        children: dict[int, int] = {}
        queued = {(access, e.id) for access, _, e in self._heap}
        for (parent_id, tokens), entry in self._entries.items():
            assert entry.parent.id == parent_id and entry.tokens == tokens, entry
            assert len(tokens) == self.page_size, entry
            parent = entry.parent
            if parent is not self.root:
                key = (parent.parent.id, parent.tokens)
                assert self._entries.get(key) is parent, f"{entry}'s parent is gone"
            children[parent_id] = children.get(parent_id, 0) + 1
            if self._evictable(entry):
                assert (entry.last_access, entry.id) in queued, f"{entry} cannot be evicted"
        for entry in (self.root, *self._entries.values()):
            assert entry.children == children.get(entry.id, 0), f"children drifted: {entry}"
