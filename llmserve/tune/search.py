"""Optuna drives the candidates; the engine's own metrics prune them; a stopped run resumes without re-measuring.

The first candidates are the points vLLM's auto_tune grid would measure first (space.grid_seeds: the defaults,
`llmserve serve` with no flags, then the --max-num-seqs x --max-num-batched-tokens corners around them;
`--grid-points` of them), enqueued as Optuna trials, so that on an equal budget tune has measured what the grid
starts with. After them, the search alternates the articles' step (change one flag of the best candidate so far, in
space.MOVE_ORDER) with the sampler's proposal (TPE, or a grid), until the budget would be overrun by one more
candidate. Every candidate is an Optuna trial in
a SQLite study: a resumed run loads the study, and a candidate whose flags were measured before is never measured
again (its figures are read back). The search stops early enough to leave the time of a confirmation round
(llmserve/tune/confirm.py): the `--confirm` best candidates re-measured back to back, the pick made on those figures.

Pruning rules, read from the measured candidates' probes (llmserve/tune/objective.py):
  kv        no larger --max-num-seqs than one whose KV cache sat full (>= 99%) with preemptions
  ttft      no smaller --max-num-batched-tokens than one whose SLO broke on TTFT (a smaller chunk only delays
            the first token further)
  tpot      no larger --max-num-batched-tokens than one whose SLO broke on TPOT while its TTFT met the bound
            with a 2x margin (a larger chunk only lengthens the decode steps)
  quality   no candidate whose answer-changing flags (dtype, quantization, KV dtype) were refused by the guard
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import optuna

from . import confirm as confirm_mod
from .space import KNOBS, Space, grid_seeds

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # TPE's multivariate mode
DONE = optuna.trial.TrialState.COMPLETE


def defaults_entry(space: Space, measured: list[dict]) -> dict | None:
    """The measured candidate whose flags are the defaults (`llmserve serve` with no flags), if it was measured."""
    key = space.key(space.defaults)
    return next((m for m in measured if space.key(m["params"]) == key), None)


@dataclass
class Outcome:
    space: Space
    measured: list[dict]  # {"params", "result", "number"} per measured candidate, in order
    pruned: list[dict]  # {"params", "rule"}
    interrupted: bool = False
    confirmation: confirm_mod.Round | None = None  # the round the pick was made by (None: no round was run)

    @property
    def best(self) -> dict | None:
        """The chosen candidate: the confirmation round's pick when a pass of it completed (with "confirmed", its
        re-measured goodput), else the best first figure."""
        c = self.confirmation
        pick = c.pick() if c else None
        if pick is not None:
            m = next(m for m in self.measured if m["number"] == pick)
            return {**m, "confirmed": c.confirmed(pick)}
        ok = [m for m in self.measured if not m["result"].get("refused") and m["result"]["goodput"] > 0]
        return max(ok, key=lambda m: m["result"]["goodput"]) if ok else None

    @property
    def defaults(self) -> dict | None:
        return defaults_entry(self.space, self.measured)

    def closest(self, bounds) -> dict | None:
        """When nothing met the SLO: the candidate whose lowest failing probe came nearest, and what failed."""
        best, score = None, math.inf
        for m in self.measured:
            probes = m["result"].get("probes") or []
            if not probes:
                continue
            p = min(probes, key=lambda p: p["rate"])
            ratios = {b.key: (p.get(b.key) or math.inf) / b.ms for b in bounds}
            worst = max(ratios.values()) if ratios else math.inf
            if worst < score:
                failed = [k for k, r in ratios.items() if r > 1] or p.get("broken") or []
                best, score = {**m, "failed": failed, "probe": p, "over": worst}, worst
        return best


def _same_but(a: dict, b: dict, knob: str) -> bool:
    return all(a[k] == b[k] for k in KNOBS if k != knob)


def prune_rule(params: dict, measured: list[dict], bounds) -> str | None:
    """Why `params` need not be measured, given what was, or None."""
    ttft = next((b for b in bounds if b.metric == "ttft"), None)
    for m in measured:
        p, r = m["params"], m["result"]
        if r.get("refused") and all(params[k] == p[k] for k in ("dtype", "quantization", "kv_cache_dtype")):
            return f"quality: dtype={p['dtype']} quantization={p['quantization']} kv={p['kv_cache_dtype']} was refused"
        probes = r.get("probes") or []
        full = any((x.get("kv_usage_max") or 0) >= 0.99 and (x.get("preemptions") or 0) > 0 for x in probes)
        if full and _same_but(params, p, "max_num_seqs") and params["max_num_seqs"] > p["max_num_seqs"]:
            return f"kv: KV cache full with preemptions at max_num_seqs={p['max_num_seqs']}"
        fail = r.get("fail")
        if fail and _same_but(params, p, "max_num_batched_tokens"):
            broke = " ".join(fail.get("broken") or [])
            if "ttft" in broke and params["max_num_batched_tokens"] < p["max_num_batched_tokens"]:
                return f"ttft: TTFT broke the SLO at max_num_batched_tokens={p['max_num_batched_tokens']}"
            margin = ttft and (fail.get(ttft.key) or math.inf) * 2 <= ttft.ms
            if "tpot" in broke and margin and params["max_num_batched_tokens"] > p["max_num_batched_tokens"]:
                budget = p["max_num_batched_tokens"]
                return f"tpot: TPOT broke with TTFT under half its bound at max_num_batched_tokens={budget}"
    return None


class Tuner:
    def __init__(
        self,
        space: Space,
        measure: Callable[[dict, str], dict],
        bounds,
        storage: str,
        study_name: str,
        budget_s: float,
        sampler: str = "tpe",
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = print,
        estimate_s: float = 60.0,
        on_result: Callable[[dict], None] | None = None,
        grid_points: int = 4,
        confirm: int = 2,
        remeasure: Callable[[dict, str, float], dict] | None = None,
    ) -> None:
        self.space, self.measure, self.bounds = space, measure, bounds
        self.clock, self.log, self.on_result = clock, log, on_result
        self.deadline = clock() + budget_s
        self.estimate_s = estimate_s
        self.grid_points, self.confirm = grid_points, confirm
        # a confirmation re-measurement: (params, tag, the rate its search starts at); default: measure again
        self.remeasure = remeasure or (lambda params, tag, start: measure(params, tag))
        self.dists = {k: optuna.distributions.CategoricalDistribution(v) for k, v in space.choices.items()}
        if sampler == "grid":
            s = optuna.samplers.GridSampler(space.choices, seed=seed)
        else:
            s = optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, multivariate=True)
        self.study = optuna.create_study(
            study_name=study_name, storage=storage, direction="maximize", sampler=s, load_if_exists=True
        )
        self.measured: list[dict] = []
        self.pruned: list[dict] = []
        self.seen: set[str] = set()
        for t in self.study.trials:  # a resumed run: what was measured is read back
            if t.state == DONE and "result" in t.user_attrs and "confirm_of" not in t.user_attrs:
                params = {k: t.params[k] for k in KNOBS}
                if space.key(params) not in self.seen:
                    self.measured.append({"params": params, "result": t.user_attrs["result"], "number": t.number})
                    self.seen.add(space.key(params))
        self.resumed = len(self.measured)
        self.measured_now = 0
        self.confirmations = confirm_mod.read_back(self.study.trials)
        self.reserved = False  # whether the search stopped to leave the confirmation round its time
        self.planned = False  # whether the last candidate was started with the round's time left after it
        self.round: confirm_mod.Round | None = None  # the round under way

    def best(self) -> dict | None:
        return Outcome(self.space, self.measured, self.pruned).best

    def _next_move(self) -> dict | None:
        best = self.best()
        base = best["params"] if best else self.space.defaults
        later = []
        for cand in self.space.moves(base):
            if self.space.key(cand) in self.seen:
                continue
            if self._lost_before(cand, base):
                later.append(cand)  # the same change lost from another base: tried after the untried ones
            else:
                return cand
        return later[0] if later else None

    def _lost_before(self, cand: dict, base: dict) -> bool:
        """Whether changing this knob to this value made another measured candidate worse (separability guess)."""
        knob = next(k for k in KNOBS if cand[k] != base[k])
        by_key = {self.space.key(m["params"]): m["result"]["goodput"] for m in self.measured}
        for m in self.measured:
            if m["params"][knob] != cand[knob]:
                continue
            for v in self.space.choices[knob]:
                parent = by_key.get(self.space.key({**m["params"], knob: v}))
                if parent is not None and v != cand[knob] and m["result"]["goodput"] < parent:
                    return True
        return False

    def need_s(self) -> float:
        """What one more measurement is budgeted: the longest so far, or the estimate before any."""
        done = [m["result"].get("seconds") for m in self.measured if m["result"].get("seconds")]
        return max(done) if done else self.estimate_s

    def contenders(self) -> list[int]:
        """The confirmation round's members: the `confirm` best first figures, and the defaults (confirm.py)."""
        d = defaults_entry(self.space, self.measured)
        return confirm_mod.contenders(self.measured, self.confirm, d["number"] if d else None)

    def _time_left_for_one(self) -> bool:
        """Whether one more candidate fits, leaving the time of the confirmation round. The round is reserved once
        two candidates could be in it (after the next one); when the time left cannot hold the next candidate and
        the round both, the search stops if the round fits now (`self.reserved`: it runs even if its measurements
        take a little longer than the longest so far), and goes on without the reserve if not."""
        need, left = self.need_s(), self.deadline - self.clock()
        good = len(self.contenders())
        after = min(self.confirm + 1, good + 1)
        reserve = after if after >= 2 else 0
        if need * (1 + reserve) <= left:
            self.planned = reserve >= 2  # a candidate slower than planned delays the round, never skips it
            return True
        if self.confirm >= 2 and good >= 2 and need * good <= left:
            self.reserved = True  # the time left goes to confirming what was found
            return False
        if need <= left:
            self.planned = False  # this candidate takes the round's time: no round unless one fits after it
            return True
        return False

    def _drop_stale_queue(self) -> None:
        """An interrupted run leaves its enqueued points waiting in the study: they are dropped (told PRUNED,
        user attribute `stale`) so that this run's queue, the grid's points first, is taken in its order."""
        while self._queued():
            trial = self.study.ask(self.dists)
            trial.set_user_attr("stale", True)
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)

    def confirm_round(self) -> confirm_mod.Round | None:
        """Re-measure the top `confirm` candidates back to back (confirm.py); None when fewer than two qualify."""
        members = self.contenders()
        if self.confirm < 2 or len(members) < 2:
            return None
        rnd = confirm_mod.choose_round(self.confirmations, members)
        if rnd.reused:
            self.log(f"confirmation round {rnd.number}: {rnd.reused} measurements read back")
        todo = len(rnd.members) - sum(r["pass"] == 0 for r in rnd.records)
        if todo and not (self.reserved or self.planned) and self.clock() + self.need_s() * todo > self.deadline:
            self.log(f"no time left to confirm the best {len(members)} candidates: chosen on the single figures")
            return rnd if rnd.records else None
        self.round = rnd  # what an interrupt keeps
        confirm_mod.run_round(self, rnd)
        return rnd

    def run(self) -> Outcome:
        interrupted = False
        turn = 0
        stale = 0
        rnd = None
        try:
            self._drop_stale_queue()
            for seed in grid_seeds(self.space, self.grid_points):
                if self.space.key(seed) not in self.seen:
                    self.study.enqueue_trial(seed, skip_if_exists=False)
            while self._time_left_for_one() and len(self.seen) < self.space.size() and stale < 50:
                turn += 1
                if turn % 4 != 0 and not self._queued():
                    move = self._next_move()
                    if move is not None:
                        self.study.enqueue_trial(move, skip_if_exists=False)
                trial = self.study.ask(self.dists)
                params = {k: trial.params[k] for k in KNOBS}
                key = self.space.key(params)
                if key in self.seen:  # the sampler proposed a measured (or pruned) point: measure nothing twice
                    self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    stale += 1
                    continue
                self.seen.add(key)
                rule = prune_rule(params, self.measured, self.bounds)
                if rule:
                    trial.set_user_attr("pruned", rule)
                    self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    self.pruned.append({"params": params, "rule": rule})
                    self.log(f"pruned {key}: {rule}")
                    continue
                stale = 0
                self.log(f"candidate {len(self.measured) + 1}: {key}")
                try:
                    result = self.measure(params, f"trial-{trial.number}")
                except KeyboardInterrupt:
                    self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    raise
                except Exception as e:  # a candidate whose server did not start: recorded, not fatal
                    result = {"goodput": 0.0, "rate": 0.0, "probes": [], "error": f"{type(e).__name__}: {e}"[:500]}
                    self.log(f"  failed: {result['error']}")
                trial.set_user_attr("result", json.loads(json.dumps(result, default=str)))
                self.study.tell(trial, result["goodput"])
                entry = {"params": params, "result": result, "number": trial.number}
                self.measured.append(entry)
                self.measured_now += 1
                if self.on_result:
                    self.on_result(entry)
            rnd = self.confirm_round()
        except KeyboardInterrupt:
            interrupted = True
            members = self.contenders()
            if self.round:
                rnd = self.round
            elif self.confirm >= 2 and len(members) >= 2:  # a round this or an earlier run measured of these members
                rnd = confirm_mod.choose_round(confirm_mod.read_back(self.study.trials), members)
                rnd = rnd if rnd.records else None
        return Outcome(self.space, self.measured, self.pruned, interrupted, rnd)

    def _queued(self) -> bool:
        return any(t.state == optuna.trial.TrialState.WAITING for t in self.study.get_trials(deepcopy=False))
