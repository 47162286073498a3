"""The confirmation round: the top few candidates re-measured back to back before one is chosen.

Every candidate of the search is measured once, at its own time; on a machine whose load drifts, a candidate
measured during a quiet minute can beat a better one measured during a busy one on that single figure. So, before
the result is written, the `--confirm` best candidates (by their first figure) are measured again one after the
other, with nothing else in between, and the pick is made on these figures alone: they were taken minutes apart
rather than across the whole search. When the time left holds another full pass, the members are measured again in
the reverse order (A B C, then C B A: a load that rises or falls steadily favours nobody over both passes), and a
member's confirmed figure is the mean over the complete passes.

Each re-measurement is recorded in the Optuna study as its own trial (user attributes `confirm_of`, the trial
number of the candidate, `round`, `pass`, `members`), so a resumed run reads them back: a round whose members are
the top candidates again is reused, and completed if it was interrupted (only its missing measurements are taken);
a different set of top candidates (the resumed search found a better one) starts a new round, numbered in the
report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_PASSES = 4  # a round never re-measures a member more often than this, however much time is left


@dataclass
class Round:
    """One confirmation round: its members (trial numbers, best first figure first) and what was re-measured."""

    number: int
    members: list[int]
    records: list[dict] = field(default_factory=list)  # {"of", "pass", "result", "number"}
    reused: int = 0  # records read back from a previous run

    def figures(self, member: int, passes: int | None = None) -> list[float]:
        done = self.passes() if passes is None else passes
        return [r["result"]["goodput"] for r in self.records if r["of"] == member and r["pass"] < done]

    def passes(self) -> int:
        """Passes every member was measured in."""
        n = 0
        while all(any(r["of"] == m and r["pass"] == n for r in self.records) for m in self.members):
            n += 1
        return n

    def confirmed(self, member: int) -> float | None:
        f = self.figures(member)
        return sum(f) / len(f) if f else None

    def pick(self) -> int | None:
        """The member with the highest confirmed figure (ties: the better first figure, i.e. the earlier member)."""
        if not self.passes():
            return None
        best = max(self.members, key=lambda m: (self.confirmed(m), -self.members.index(m)))
        return best if self.confirmed(best) > 0 else None

    def as_dict(self) -> dict:
        return {
            "round": self.number,
            "members": self.members,
            "passes": self.passes(),
            "reused": self.reused,
            "confirmed": {str(m): self.confirmed(m) for m in self.members},
            "records": [
                {k: r[k] for k in ("of", "pass", "number")} | {"goodput": r["result"]["goodput"]} for r in self.records
            ],  # fmt: skip
        }


def contenders(measured: list[dict], k: int, baseline: int | None = None) -> list[int]:
    """The trial numbers of the `k` best candidates by their first figure (those meeting the SLO, not refused), and
    the `baseline` (the defaults' trial) after them when it met the SLO and is not among them: a candidate that won
    its first measurement by noise must beat the defaults side by side to be chosen over them."""
    ok = [m for m in measured if not m["result"].get("refused") and m["result"]["goodput"] > 0]
    ok.sort(key=lambda m: (-m["result"]["goodput"], m["number"]))
    top = [m["number"] for m in ok[:k]]
    if k >= 2 and baseline is not None and baseline not in top and any(m["number"] == baseline for m in ok):
        top.append(baseline)
    return top


def read_back(trials) -> list[dict]:
    """The confirmation measurements a study holds (a resumed run's)."""
    out = []
    for t in trials:
        a = t.user_attrs
        if "confirm_of" in a and "result" in a and t.state.is_finished():
            out.append({"of": a["confirm_of"], "round": a["round"], "pass": a["pass"], "members": a["members"],
                        "result": a["result"], "number": t.number})  # fmt: skip
    return out


def choose_round(records: list[dict], members: list[int]) -> Round:
    """The latest round with exactly these members (to reuse or complete), or a new one."""
    rounds: dict[int, Round] = {}
    for r in records:
        rnd = rounds.setdefault(r["round"], Round(r["round"], list(r["members"])))
        rnd.records.append(r)
    same = [rnd for rnd in rounds.values() if set(rnd.members) == set(members)]
    if same:
        rnd = max(same, key=lambda x: x.number)
        rnd.reused = len(rnd.records)
        return rnd
    return Round(max(rounds, default=0) + 1, list(members))


def run_round(tuner, rnd: Round) -> None:
    """Measure what the round lacks: the first pass always (its time was reserved), further passes while a whole
    one fits in the budget. KeyboardInterrupt propagates; what was measured is recorded first."""
    import optuna

    by_number = {m["number"]: m for m in tuner.measured}
    start = by_number[rnd.members[0]]["result"]["rate"]  # every member's rate search starts at the same rate
    p = 0
    while p < MAX_PASSES:
        order = rnd.members if p % 2 == 0 else list(reversed(rnd.members))
        todo = [m for m in order if not any(r["of"] == m and r["pass"] == p for r in rnd.records)]
        if p > 0 and todo and tuner.clock() + tuner.need_s() * len(todo) > tuner.deadline:
            return
        for number in todo:
            params = by_number[number]["params"]
            tag = f"confirm-r{rnd.number}-p{p}-trial-{number}"
            tuner.log(f"confirming (round {rnd.number}, pass {p + 1}) trial {number}: {tuner.space.key(params)}")
            try:
                result = tuner.remeasure(params, tag, start)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - a server that did not start this time: recorded, not fatal
                result = {"goodput": 0.0, "rate": 0.0, "probes": [], "error": f"{type(e).__name__}: {e}"[:500]}
            result = json.loads(json.dumps(result, default=str))
            attrs = {"confirm_of": number, "round": rnd.number, "pass": p, "members": rnd.members, "result": result}
            trial = optuna.trial.create_trial(
                params=params, distributions=tuner.dists, value=result["goodput"], user_attrs=attrs
            )
            tuner.study.add_trial(trial)
            number_now = tuner.study.get_trials(deepcopy=False)[-1].number
            rnd.records.append({"of": number, "pass": p, "result": result, "number": number_now})
            tuner.log(f"  confirmed goodput {result['goodput']:.3g}/s (first figure "
                      f"{by_number[number]['result']['goodput']:.3g}/s)")  # fmt: skip
        p += 1
