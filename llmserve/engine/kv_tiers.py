"""The tiers of the prefix cache below RAM, in the order a miss looks them up: the disk (`--kv-cache-dir`,
kv_disk.py), then the store every replica shares (`--kv-cache-url`, kv_remote.py). `open_kv_tiers` gives
the engine one object with the tiers' interface (`load`, `save`, `flush`, `close`, `stats`), whichever are on.
"""

from __future__ import annotations

from llmserve.engine.kv_disk import open_disk_tier
from llmserve.engine.kv_remote import open_remote_tier


class TierStack:
    """Several tiers as one: a block missing in one is looked up in the next; every tier keeps what steps
    compute (the shared store also gets what this replica read from its disk)."""

    def __init__(self, tiers: list) -> None:
        self.tiers = tiers

    def load(self, kv, request, hits: list, max_blocks: int) -> list:
        found: list = []
        for tier in self.tiers:
            if len(hits) + len(found) >= max_blocks:
                break
            found += tier.load(kv, request, hits + found, max_blocks)
        return found

    def save(self, sched, kv) -> None:
        for tier in self.tiers:
            tier.save(sched, kv)

    def flush(self, timeout: float = 60.0) -> None:
        for tier in self.tiers:
            tier.flush(timeout)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def stats(self) -> dict:
        """Every tier's counters; vLLM's external_prefix_cache_* over them all (queries: the tokens looked up
        below RAM, by the first tier; hits: the tokens any tier gave)."""
        out: dict = {}
        for tier in self.tiers:
            out.update(tier.stats())
        parts = [t.stats() for t in self.tiers]
        out["external_prefix_cache_queries"] = parts[0]["external_prefix_cache_queries"]
        out["external_prefix_cache_hits"] = sum(p["external_prefix_cache_hits"] for p in parts)
        return out


def open_kv_tiers(plan, model_path: str, weights_dtype, kv_caches: list, step_started):
    """The tiers the plan turns on (kv_plan.KVPlan's `disk`, `store`) over the runner's `kv_caches`: None, one
    tier, or a TierStack; a disk tier that cannot write its folder is left out with one warning (serving goes
    on). `step_started()`: when the engine's current step began (the store's reads give way to a late step)."""
    tiers = []
    if plan.disk is not None:
        tiers.append(open_disk_tier(plan.disk, model_path, weights_dtype, kv_caches))
    if plan.store is not None:
        root = plan.disk.root if plan.disk is not None else None
        tiers.append(open_remote_tier(plan.store, model_path, weights_dtype, kv_caches, step_started, root))
    tiers = [t for t in tiers if t is not None]
    if not tiers:
        return None
    return tiers[0] if len(tiers) == 1 else TierStack(tiers)
