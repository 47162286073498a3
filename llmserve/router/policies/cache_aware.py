"""`cache_aware` (the default): a request goes to the backend that holds the longest prefix of it in its KV
cache, unless load is imbalanced (absolute *and* relative gap, as SGLang's router does), in which case least
outstanding wins. What a backend holds is known from its KV events (`Backend.kv_blocks`, the names of the
blocks in its cache, matched against the request's token ids) where it publishes them, and guessed from an
approximate radix tree of the prompts recently routed to it where it does not."""

from __future__ import annotations

from collections import OrderedDict

from llmserve.engine.kv_events import chain_digests, chain_extra

from .base import Backend, Decision, Policy, RouteRequest

REASON_CACHE_HIT = "cache_hit"
REASON_CACHE_MISS = "cache_miss"
REASON_BALANCE = "balance"


class _Node:
    __slots__ = ("label", "children", "tenants")

    def __init__(self, label: str = ""):
        self.label = label  # edge label from the parent
        self.children: dict[str, _Node] = {}  # first character -> child
        self.tenants: dict[int, int] = {}  # backend id -> how many stored prompts pass here


class PrefixTree:
    """A radix tree over prompt text shared by all backends ("tenants").

    Every node counts, per tenant, how many of that tenant's stored prompts pass through it, so a
    tenant present at a node is present at all its ancestors. `match` returns, per tenant, the
    length of the longest stored prefix; `insert`/`remove` keep the counts. Each tenant keeps its
    most recent prompts up to `max_chars_per_tenant` characters (an LRU, like the KV cache it
    approximates); older ones are removed from the tree.
    """

    def __init__(self, max_chars_per_tenant: int = 200_000, max_prompt_chars: int = 32_768):
        self.root = _Node()
        self.max_chars_per_tenant = max_chars_per_tenant
        self.max_prompt_chars = max_prompt_chars
        self._recent: dict[int, OrderedDict[str, int]] = {}  # tenant -> prompt -> length
        self._chars: dict[int, int] = {}

    # -- queries --
    def match(self, text: str) -> dict[int, int]:
        text = text[: self.max_prompt_chars]
        matched: dict[int, int] = {}
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            n = _common_prefix_len(child.label, text, i)
            for t in child.tenants:
                matched[t] = i + n  # deeper nodes overwrite shallower ones
            if n < len(child.label):
                break
            node, i = child, i + n
        return matched

    def size(self, tenant: int) -> int:
        return self._chars.get(tenant, 0)

    # -- updates --
    def insert(self, text: str, tenant: int) -> None:
        text = text[: self.max_prompt_chars]
        if not text:
            return
        recent = self._recent.setdefault(tenant, OrderedDict())
        if text in recent:  # already stored: refresh its recency only
            recent.move_to_end(text)
            return
        self._add_path(text, tenant, +1)
        recent[text] = len(text)
        self._chars[tenant] = self._chars.get(tenant, 0) + len(text)
        while self._chars[tenant] > self.max_chars_per_tenant and len(recent) > 1:
            old, n = recent.popitem(last=False)
            self._chars[tenant] -= n
            self._add_path(old, tenant, -1)

    def remove_tenant(self, tenant: int) -> None:
        for text in list(self._recent.pop(tenant, {})):
            self._add_path(text, tenant, -1)
        self._chars.pop(tenant, None)

    def _add_path(self, text: str, tenant: int, delta: int) -> None:
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                if delta < 0:
                    return
                child = _Node(text[i:])
                node.children[text[i]] = child
            n = _common_prefix_len(child.label, text, i)
            if n < len(child.label):
                if delta < 0:  # a removal always follows an inserted path
                    return
                child = self._split(node, child, n)
            count = child.tenants.get(tenant, 0) + delta
            if count > 0:
                child.tenants[tenant] = count
            else:
                child.tenants.pop(tenant, None)
                if not child.tenants:  # counts shrink downwards: the subtree is empty
                    del node.children[child.label[0]]
                    return
            node, i = child, i + n

    @staticmethod
    def _split(parent: _Node, child: _Node, n: int) -> _Node:
        mid = _Node(child.label[:n])
        mid.tenants = dict(child.tenants)
        child.label = child.label[n:]
        mid.children[child.label[0]] = child
        parent.children[mid.label[0]] = mid
        return mid


def _common_prefix_len(label: str, text: str, start: int) -> int:
    """Length of the common prefix of `label` and `text[start:]`, by slice comparisons (done in C)
    and a binary search for the first difference: prompts are long and usually match whole."""
    n = min(len(label), len(text) - start)
    if label[:n] == text[start : start + n]:
        return n
    lo, hi = 0, n  # label[:lo] matches, label[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if label[lo:mid] == text[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class CacheAware(Policy):
    """SGLang-style cache-aware routing.

    1. If load is imbalanced (max - min > `balance_abs_threshold` and max > min *
       `balance_rel_threshold`), route to the least loaded backend ("balance").
    2. Otherwise find the backend that holds the longest prefix of this prompt: for a backend that
       publishes KV events, the leading blocks of the request's token ids in its cache; for the others,
       the longest prefix its stored prompts share with this one. If the matched fraction exceeds
       `cache_threshold`, route there ("cache_hit"). A block a backend evicted is not matched there.
    3. Else route to the backend with the smallest tree, i.e. the most free cache ("cache_miss"),
       ties broken by load.
    The prompt is then recorded in the chosen backend's tree.
    """

    name = "cache_aware"

    def __init__(
        self,
        use_metrics: bool = False,
        cache_threshold: float = 0.5,
        balance_abs_threshold: float = 32,
        balance_rel_threshold: float = 1.5,
        max_chars_per_tenant: int = 200_000,
    ):
        super().__init__(use_metrics)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_chars_per_tenant=max_chars_per_tenant)

    def imbalanced(self, candidates: list[Backend]) -> bool:
        loads = [b.load(self.use_metrics) for b in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def choose(self, req: RouteRequest, candidates: list[Backend]) -> Decision:
        if len(candidates) > 1 and self.imbalanced(candidates):
            return Decision(self.least_loaded(candidates), REASON_BALANCE)
        text = req.prompt_text
        if text or req.token_ids:
            best, best_frac = None, 0.0
            for b, frac in self.matched(req, candidates):
                if frac > best_frac or (
                    frac == best_frac
                    and best is not None
                    and frac > 0
                    and b.load(self.use_metrics) < best.load(self.use_metrics)
                ):
                    best, best_frac = b, frac
            if best is not None and best_frac > self.cache_threshold:
                return Decision(best, REASON_CACHE_HIT)
        smallest = min(self.tree.size(id(b)) for b in candidates)
        emptiest = [b for b in candidates if self.tree.size(id(b)) == smallest]
        return Decision(self.least_loaded(emptiest), REASON_CACHE_MISS)

    def matched(self, req: RouteRequest, candidates: list[Backend]):
        """(backend, fraction of the prompt it holds) per candidate."""
        text, tokens = req.prompt_text, req.token_ids
        tree = self.tree.match(text) if text and any(b.kv_blocks is None or not tokens for b in candidates) else {}
        names: dict[int, list[str]] = {}  # block size -> the request's block names
        lora = (
            req.model if req.model and any(b.model_cards.get(req.model, {}).get("parent") for b in candidates) else None
        )
        for b in candidates:
            if b.kv_blocks is not None and tokens:  # its real cache
                bs = b.kv_block_size
                if bs not in names:
                    names[bs] = [d.hex() for d in chain_digests(tokens, bs, chain_extra(None, lora))]
                n = 0
                for name in names[bs]:
                    if name not in b.kv_blocks:
                        break
                    n += 1
                yield b, n * bs / len(tokens)
            else:
                yield b, tree.get(id(b), 0) / max(min(len(text), self.tree.max_prompt_chars), 1)

    def on_routed(self, req: RouteRequest, backend: Backend) -> None:
        if req.prompt_text:
            self.tree.insert(req.prompt_text, id(backend))

    def on_backend_removed(self, backend: Backend) -> None:
        self.tree.remove_tenant(id(backend))
