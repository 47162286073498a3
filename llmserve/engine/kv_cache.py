"""KV cache block management: a pool of fixed-size blocks, prefix caching by chained block hashes,
and O(1) least-recently-used eviction through a doubly linked free list.

Pure bookkeeping: no tensors. Block `i` here is block `i` of every layer's KV tensor in the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from llmserve.engine.request import Request

# A block's identity: (parent block's hash, its tokens, extras such as a cache salt). Python's tuple
# hash chains the parent in; the dict compares whole keys, so two different blocks never match.
BlockHash = tuple


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: "KVCacheBlock | None" = field(default=None, repr=False)
    next_free: "KVCacheBlock | None" = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks. Front = evicted first (least recently used)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def appendleft(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, "block is already free"
        first = self._head.next_free
        self._head.next_free, block.prev_free = block, self._head
        block.next_free, first.prev_free = first, block
        self.num_free += 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, "block is already free"
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """All blocks, the free list, and the map from block hash to a cached block."""

    def __init__(self, num_blocks: int, enable_caching: bool, on_removed=None) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # (parent's hash, extras) -> the cached blocks that follow that parent: where a prompt's tail is looked up
        self.children: dict[tuple, dict[BlockHash, None]] = {}
        self.enable_caching = enable_caching
        self.on_removed = on_removed  # called with a block whose hash is dropped (KV events)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def get_cached(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def find_tail(self, parent: BlockHash | None, tokens: list[int], extra: tuple) -> KVCacheBlock | None:
        """A cached block after `parent` (None: the first block) whose first tokens are `tokens`, under the same
        extras (cache salt, adapter): it holds a partial block's KV, which only full blocks are named by."""
        n = len(tokens)
        want = tuple(tokens)
        for key in self.children.get(((hash(parent) if parent is not None else 0), extra), ()):
            if key[1][:n] == want:
                return self.cached[key]
        return None

    def _name(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.children.setdefault((block_hash[0], block_hash[2:]), {})[block_hash] = None

    def _forget(self, block: KVCacheBlock) -> None:
        """Drop the name of a block that holds it (the caller checked), and tell KV events."""
        key = block.block_hash
        del self.cached[key]
        siblings = self.children[(key[0], key[2:])]
        del siblings[key]
        if not siblings:
            del self.children[(key[0], key[2:])]
        if self.on_removed is not None:
            self.on_removed(block)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict its cached contents
                if self.cached.get(block.block_hash) is block:
                    self._forget(block)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks that reach zero go to the back of the free list (kept cached), or to
        the front when they hold nothing to reuse (no hash: a partial last block, caching off): they are
        taken again first, so cached blocks live longer and fewer fresh pages of the pool are touched."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's hash: its contents are not what the hash names."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            self._forget(block)
        block.block_hash = None

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Name `block` by `block_hash`; False when it already has a name or another block has this one."""
        if block.block_hash is not None:
            return False
        if block_hash in self.cached:  # same contents already cached in another block
            return False
        self._name(block, block_hash)
        return True


class KVCacheManager:
    """Blocks per request: prefix-cache look-up, allocation for the tokens of a step, freeing.

    Beside the main pool, each optional part is given at construction (kv_plan.kv_manager builds them from a KVPlan):
    `window`, a WindowGroup (kv_window.py): the sliding-window layers' own pool, where they give back the blocks
    their window has passed (None: every layer's blocks are this pool's); `states`, a StatePool (state_pool.py):
    a hybrid model's recurrent state slots, one per sequence it schedules; `events`, a KVEventLog (kv_events.py,
    --kv-events-config): the blocks named and dropped; `disk`, a tier below RAM (kv_disk.DiskTier, --kv-cache-dir):
    `load` after a miss in RAM, `save` after each step, `stats`, `close`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        *,
        window=None,
        states=None,
        events=None,
        disk=None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events
        self.pool = BlockPool(num_blocks, enable_caching, events.removed if events is not None else None)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up (count_prefix_hits: once a request)
        self.prefix_cache_hits = 0  # prompt tokens found
        self.disk = disk
        self.window = window
        self.states = states
        # copies on write of this schedule: (cached source, a request's own block), the source held until
        # fill_tables hands them to the runner; the blocks named in this schedule (their KV is not computed yet)
        self._copies: list[list[KVCacheBlock | None]] = []
        self._fresh: set[int] = set()

    def fill_tables(self, out) -> None:
        """The block tables of the requests a SchedulerOutput runs, and the copies on write to make before its
        step, written into it (what the runner reads)."""
        out.block_copies = [(src.block_id, dst.block_id) for src, dst in self._copies if dst is not None]
        self.pool.free(src for src, _ in self._copies)  # (nothing is allocated before the runner copies)
        self._copies.clear()
        self._fresh.clear()  # the step computes them
        for r in out.requests:
            rid = r.request_id
            out.block_ids[rid] = self.get_block_ids(rid)
            if self.window is not None:
                out.window_tables[rid] = self.window.table(rid)
            if self.states is not None:
                out.state_slots[rid] = self.states.slot(rid)

    # -- hashing -------------------------------------------------------------------------------
    @staticmethod
    def _extra(request: Request) -> tuple:
        """What a block's KV depends on besides its tokens and parent: the cache salt and the adapter."""
        extra = (request.cache_salt,) if request.cache_salt else ()
        if request.lora is not None:  # KV computed under an adapter is that adapter's (per load)
            extra += (("lora", request.lora.adapter_id),)
        return extra

    def _update_block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        extra = self._extra(request)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), len(tokens) // bs):
            key = (hash(parent) if parent is not None else 0, tuple(tokens[i * bs : (i + 1) * bs])) + extra
            # the images whose placeholders fall in the block: their content decides its KV, not the tokens
            key += tuple(
                ("image", im.content_hash) for im in request.images if im.start < (i + 1) * bs and im.end > i * bs
            )
            hashes.append(key)
            parent = key
        return hashes

    # -- API used by the scheduler -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free); with a window
        group, that of the fuller pool."""
        used = 1.0 - self.pool.num_free / self.num_blocks if self.num_blocks else 0.0
        if self.window is not None:
            used = max(used, 1.0 - self.window.pool.num_free / self.window.num_blocks)
        return used

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix: (hit blocks, tokens cached). The prompt's last token is always computed (its
        step yields the logits to sample from), and only it where the hits reach it: a prompt of whole blocks all
        cached, or a cached block that begins with the prompt's partial tail (`BlockPool.find_tail`, as
        llama.cpp reuses a slot's tokens). Then tokens cached is num_tokens - 1 and allocate_slots copies the last
        hit into a block of the request's own (copy on write: the cached block stays as it is). With a window
        group or recurrent state, whole blocks before the last token only (a state cannot be copied back)."""
        if not self.enable_caching:
            return [], 0
        hashes = self._update_block_hashes(request)
        n, bs = request.num_tokens, self.block_size
        whole = self.window is None and self.states is None
        max_blocks = n // bs if whole else (n - 1) // bs
        hits: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached(h)
            if block is None:
                break
            hits.append(block)
        if self.disk is not None and len(hits) < max_blocks:
            hits += self.disk.load(self, request, hits, max_blocks)
        if self.window is not None:  # usable only where the window layers still hold its last window
            hits = hits[: self.window.usable_hit(hashes, len(hits))]
        if whole and len(hits) == n // bs and n % bs and not request.images:
            parent = hits[-1].block_hash if hits else None
            tail = self.pool.find_tail(parent, request.all_token_ids[len(hits) * bs : n], self._extra(request))
            if tail is not None:
                hits.append(tail)
        if hits and len(hits) * bs >= n and hits[-1].block_id in self._fresh:
            hits.pop()  # to be computed in this very step: nothing to copy yet
        return hits, self._cached_tokens(request, hits)

    def count_prefix_hits(self, request: Request, num_cached: int) -> None:
        """vLLM's prefix_cache_queries/hits: a request's prompt tokens and the ones its look-up found, counted once,
        by the scheduler in the step that first schedules it (not at each look-up while it waits for room)."""
        if self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached

    def _cached_tokens(self, request: Request, computed: list[KVCacheBlock]) -> int:
        """Tokens a run of hits spares (all but the last prompt token); fewer than it covers: copy on write."""
        return min(len(computed) * self.block_size, request.num_tokens - 1) if computed else 0

    def blocks_needed(self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock] | None = None) -> int:
        computed = computed or []
        held = len(self.req_blocks.get(request.request_id, ())) + len(computed)
        cached = self._cached_tokens(request, computed)
        total = request.num_computed_tokens + cached + num_new_tokens
        need = -(-total // self.block_size) - held + (cached < len(computed) * self.block_size)
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        return max(need, 0) + evictable_hits

    def _window_args(self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock]) -> tuple[int, int, int]:
        """(first query position, positions after the step, hit blocks) for the window group."""
        start = request.num_computed_tokens + len(computed) * self.block_size
        return start, start + num_new_tokens, len(computed)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request` (after `computed` cached blocks).
        Returns the newly allocated blocks, or None (and changes nothing) if the pool is too full."""
        computed = computed or []
        if self.blocks_needed(request, num_new_tokens, computed) > self.pool.num_free:
            return None
        states = self.states
        if states is not None and not states.has_slot(request.request_id) and states.num_free == 0:
            return None
        window = self.window
        if window is not None:
            args = self._window_args(request, num_new_tokens, computed)
            if window.blocks_needed(request, *args) > window.pool.num_free:
                return None
            window.allocate(request, *args)
        if states is not None:
            states.allocate(request.request_id)  # (its slot, taken when first scheduled)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        cached = self._cached_tokens(request, computed)
        src = None
        if computed:
            self.pool.touch(computed)
            if cached < len(computed) * self.block_size:
                src, computed = computed[-1], computed[:-1]
            blocks.extend(computed)
            self.num_cached_blocks[request.request_id] = len(computed)
        if src is not None:  # the last hit holds the token to compute: copy on write, into a block of its own
            dst = self.pool.allocate(1)[0]
            blocks.append(dst)
            self._copies.append([src, dst])  # (src keeps the reference touch took, until fill_tables)
        num_computed = request.num_computed_tokens + cached
        total = num_computed + num_new_tokens
        need = -(-total // self.block_size) - len(blocks)
        new_blocks = self.pool.allocate(need) if need > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Only blocks whose every token is known (prompt, or already sampled) can be named by hash.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._update_block_hashes(request)
        for i in range(start, num_full):
            self.cache_block(request, i, blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full
        if self.window is not None:
            self.window.name_blocks(request, num_full)

    def cache_block(self, request: Request, index: int, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Name block `index` of `request` by its hash (and publish it with KV events)."""
        if self.pool.cache_block(block, block_hash):
            self._fresh.add(block.block_id)
            if self.events is not None:
                self.events.stored(request, index, block)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # Blocks are named by hash when allocated, ahead of the step that computes them; a request freed
        # before that step ran (preempted in the schedule that allocated them) leaves them uncomputed:
        # forget their hashes, unless another request holds them too.
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block.ref_cnt == 1:
                self.pool.uncache(block)
        for copy in self._copies:  # a copy on write into a block given back: not made
            if copy[1] is not None and copy[1] in blocks:
                copy[1] = None
        # Tail blocks first: they are the least likely to be shared, so they are evicted first.
        self.pool.free(reversed(blocks))
        if self.window is not None:
            self.window.free(request)
        if self.states is not None:
            self.states.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
