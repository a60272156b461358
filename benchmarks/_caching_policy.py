"""A simulation of PyTorch's CUDA caching-allocator policy (c10/cuda/CUDACachingAllocator.cpp,
default settings), for replaying allocation traces without a GPU.

What it models, with PyTorch's constants: every request rounded up to a multiple of 512 B
(minimum 512 B); requests <= 1 MiB served from the small pool, packed into 2 MiB segments;
larger ones from the large pool, where a request below 10 MiB gets a 20 MiB segment and a
bigger one a segment rounded up to 2 MiB; best fit (smallest free block that fits, then lowest
address) within the pool; a block is split when the remainder is >= 512 B (small pool) or
> 1 MiB (large pool); a freed block merges with its free neighbours of the same segment.
What it leaves out: streams (traces are single-stream), the oversize rules of max_split_size
(off by default), garbage collection and cache flushes on cudaMalloc failure (no cap here).

``expandable=True`` models ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (CCA.cpp
``find_expandable_block`` / ``try_allocate_expandable_block`` / ``map_block``): one segment per
pool over reserved address space, physical pages mapped at its end on demand, 2 MiB pages for the
small pool and 20 MiB for the large one; the free block at the mapped end merges with new pages;
best fit treats that end block as if it extended over the unmapped space, so it is chosen only
when no other free block fits; every split whose remainder is >= 512 B is made. Pages are never
unmapped here (PyTorch unmaps only on empty_cache or a failed allocation, and there is no cap).
"""

from __future__ import annotations

import bisect

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class _Block:
    __slots__ = ("addr", "size", "free", "prev", "next", "small")

    def __init__(self, addr, size, small):
        self.addr, self.size, self.small = addr, size, small
        self.free, self.prev, self.next = True, None, None


class CachingAllocatorSim:
    def __init__(self, expandable: bool = False) -> None:
        self.free_sets = {True: [], False: []}  # small? -> sorted [(size, addr)]
        self.by_addr: dict[int, _Block] = {}
        self.next_addr = 1 << 40
        self.reserved = self.peak_reserved = 0
        self.segments = 0
        self.expandable = expandable
        # expandable: per pool, the end of its segment's mapped pages (from the segment's base on)
        self.es_end = {True: 1 << 44, False: 1 << 45}
        self.es_last: dict[bool, _Block | None] = {True: None, False: None}  # block ending at es_end

    def _malloc_expandable(self, size: int, small: bool) -> _Block:
        lst = self.free_sets[small]
        i = bisect.bisect_left(lst, (size, -1))
        last = self.es_last[small]
        tail = last if last is not None and last.free else None
        # best fit, the mapped end taken only when nothing else fits (its "expandable size" is huge)
        if i < len(lst) and tail is not None and lst[i][1] == tail.addr:
            i += 1
        if i < len(lst):
            b = self.by_addr[lst.pop(i)[1]]
        else:
            page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
            have = tail.size if tail is not None else 0
            if have < size:
                grow = _round_up(size - have, page)
                self.reserved += grow
                self.peak_reserved = max(self.peak_reserved, self.reserved)
                if tail is None:
                    tail = _Block(self.es_end[small], 0, small)
                    tail.prev = last
                    if last is not None:
                        last.next = tail
                    self.by_addr[tail.addr] = tail
                    self.es_last[small] = tail
                    if last is None:
                        self.segments += 1
                else:
                    self._remove(tail)
                tail.size += grow
                self.es_end[small] += grow
            else:
                self._remove(tail)
            b = tail
        if b.size - size >= K_MIN_BLOCK:
            self._split(b, size)
        b.free = False
        return b

    def _split(self, b: _Block, size: int) -> None:
        """Cuts b to size; the rest becomes a free block right after it (in expandable mode, the
        new block at the mapped end when b was there)."""
        rest = _Block(b.addr + size, b.size - size, b.small)
        rest.prev, rest.next = b, b.next
        if b.next:
            b.next.prev = rest
        elif self.expandable:
            self.es_last[b.small] = rest
        b.next = rest
        b.size = size
        self.by_addr[rest.addr] = rest
        self._insert(rest)

    def _insert(self, b: _Block) -> None:
        bisect.insort(self.free_sets[b.small], (b.size, b.addr))

    def _remove(self, b: _Block) -> None:
        lst = self.free_sets[b.small]
        del lst[bisect.bisect_left(lst, (b.size, b.addr))]

    def malloc(self, request: int) -> int:
        size = K_MIN_BLOCK if request < K_MIN_BLOCK else _round_up(request, K_MIN_BLOCK)
        small = size <= K_SMALL_SIZE
        if self.expandable:
            return self._malloc_expandable(size, small).addr
        lst = self.free_sets[small]
        i = bisect.bisect_left(lst, (size, -1))
        if i < len(lst):
            _, addr = lst.pop(i)
            b = self.by_addr[addr]
        else:
            if small:
                seg = K_SMALL_BUFFER
            else:
                seg = K_LARGE_BUFFER if size < K_MIN_LARGE_ALLOC else _round_up(size, K_ROUND_LARGE)
            b = _Block(self.next_addr, seg, small)
            self.next_addr += seg + K_ROUND_LARGE  # segments never touch, so never merge
            self.by_addr[b.addr] = b
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            self.segments += 1
        remaining = b.size - size
        if (small and remaining >= K_MIN_BLOCK) or (not small and remaining > K_SMALL_SIZE):
            self._split(b, size)
        b.free = False
        return b.addr

    def free(self, addr: int) -> None:
        b = self.by_addr[addr]
        b.free = True
        for n in (b.next, b.prev):
            if n is not None and n.free:
                self._remove(n)
                lo, hi = (b, n) if n is b.next else (n, b)
                lo.size += hi.size
                lo.next = hi.next
                if hi.next:
                    hi.next.prev = lo
                elif self.es_last[lo.small] is hi:
                    self.es_last[lo.small] = lo
                del self.by_addr[hi.addr]
                b = lo
        self._insert(b)
