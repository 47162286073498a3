"""The blocks of the sliding-window layers (Gemma 2 / 3, Mistral with a window, gpt-oss style models).

A layer that attends to the last `window` positions never reads a key again once every query from now on
lies more than `window` past it: a query at position p reads positions p - window + 1 .. p. So the window
layers keep their own block pool (their own cache tensors in the runner) and their own block list per
request, in which the blocks wholly before the next query's window are given back (their entries become
None). A long sequence then holds what its window costs in those layers, however long it grows; the
full-attention layers keep the ordinary pool (`KVCacheManager`), which names blocks and counts prefix hits.

A prefix-cache hit of `h` blocks is usable only where the window layers still hold (by the same chained
block hashes, in their own pool) the blocks the first computed query reads: those covering the last window
before position h * block_size. `usable_hit` shortens a hit until they do.

Bookkeeping only: no tensors.
"""

from __future__ import annotations

from llmserve.engine.kv_cache import BlockHash, BlockPool, KVCacheBlock
from llmserve.engine.request import Request


class WindowGroup:
    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock | None]] = {}
        self.first_held: dict[str, int] = {}  # request id -> its first block not given back (all before: None)
        self.num_named: dict[str, int] = {}

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` (or any later one) reads."""
        return max(0, position - self.window + 1) // self.block_size

    def blocks_per_sequence(self, chunk: int) -> int:
        """Most blocks one sequence holds at once: its window plus a step's chunk of new tokens."""
        return -(-(self.window - 1 + chunk) // self.block_size) + 1

    # -- prefix caching -------------------------------------------------------------------------------
    def usable_hit(self, hashes: list[BlockHash], num_hit: int) -> int:
        """The longest hit <= `num_hit` blocks whose last window is still cached in this group's pool."""
        last_missing = -1
        missing_before = []  # [i]: the last index < i whose block this pool lacks
        for i in range(num_hit):
            missing_before.append(last_missing)
            if self.pool.get_cached(hashes[i]) is None:
                last_missing = i
        missing_before.append(last_missing)
        for h in range(num_hit, 0, -1):
            if missing_before[h] < self.first_needed(h * self.block_size):
                return h
        return 0

    def _hit_blocks(self, request: Request, num_hit: int) -> list[KVCacheBlock | None]:
        """The request's list after a hit of `num_hit` blocks: None before the window, the cached blocks in it."""
        first = self.first_needed(num_hit * self.block_size)
        out: list[KVCacheBlock | None] = [None] * first
        for h in request.block_hashes[first:num_hit]:
            block = self.pool.get_cached(h)
            assert block is not None, "a window hit checked by usable_hit has lost its block"
            out.append(block)
        return out

    # -- allocation -----------------------------------------------------------------------------------
    def blocks_needed(self, request: Request, start: int, total: int, num_hit: int) -> int:
        """Free blocks of this pool that giving `request` positions up to `total` takes, its queries starting
        at `start` (after a hit of `num_hit` blocks for a new request); blocks it gives back count as free."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks is None:
            held = num_hit
            hits = self._hit_blocks(request, num_hit) if num_hit else []
            returned = 0
            evictable = sum(1 for b in hits if b is not None and b.ref_cnt == 0)
        else:
            held = len(blocks)
            passed = blocks[self.first_held[request.request_id] : self.first_needed(start)]
            returned = sum(1 for b in passed if b.ref_cnt == 1)
            evictable = 0
        return max(-(-total // self.block_size) - held, 0) + evictable - returned

    def allocate(self, request: Request, start: int, total: int, num_hit: int) -> None:
        """Give back the blocks before the window of a query at `start`, then take blocks up to `total`
        (the caller has checked `blocks_needed`)."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            blocks = self.req_blocks[rid] = self._hit_blocks(request, num_hit) if num_hit else []
            self.pool.touch(b for b in blocks if b is not None)
            self.first_held[rid] = self.first_needed(num_hit * self.block_size) if num_hit else 0
            self.num_named[rid] = num_hit
        self.release(rid, start)
        need = -(-total // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))

    def release(self, request_id: str, position: int) -> None:
        """Give back the request's blocks that no query at `position` or later reads."""
        blocks = self.req_blocks.get(request_id, [])
        held, first = self.first_held.get(request_id, 0), min(self.first_needed(position), len(blocks))
        if first > held:
            passed = blocks[held:first]
            blocks[held:first] = [None] * (first - held)
            self.first_held[request_id] = first
            self.pool.free(reversed(passed))

    def name_blocks(self, request: Request, num_full: int) -> None:
        """Name the request's full blocks by their hashes (as the full-attention pool names its own)."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        start = self.num_named.get(rid, 0)
        for i in range(start, min(num_full, len(blocks))):
            if blocks[i] is not None:
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_named[rid] = max(start, num_full)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.first_held.pop(request.request_id, None)
        self.num_named.pop(request.request_id, None)
        # (as KVCacheManager.free: blocks named ahead of a step that never ran hold nothing)
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block is not None and block.ref_cnt == 1:
                self.pool.uncache(block)
        self.pool.free(reversed([b for b in blocks if b is not None]))

    def table(self, request_id: str) -> tuple[int, list[int]]:
        """(first held block's index, the held blocks' ids from there): the kernels see the request's
        positions from that block on, shifted down by its index times the block size."""
        first = self.first_held.get(request_id, 0)
        return first, [b.block_id for b in self.req_blocks.get(request_id, [])[first:]]
