"""llmserve tune's search on a synthetic measured landscape (a function from flags to figures, no model): it finds the
optimum within its budget, the grid's first points are measured first, the confirmation round picks the true best
when noise flattered another candidate once, a resumed run measures nothing twice (confirmation included), an SLO
that nothing meets names the closest candidate and the percentile that failed, the engine-metric pruning rules, the
rate bisection, and the bad input refused before any server starts."""

from __future__ import annotations

import asyncio
import types

import pytest

from llmserve.tune import cli, slo, space
from llmserve.tune.objective import rate_search
from llmserve.tune.search import Tuner, prune_rule

BOUNDS = slo.parse_slo("ttft_p95=2000,tpot_p95=100")


def make_space() -> space.Space:
    # 2 cores with native bfloat16; a 135M-like model (0.2 GFLOP a token, 46 KB of KV a token)
    return space.derive(2 * 10**8 // 1, 46080, 700, cores=2, bf16=True)


def landscape(params: dict) -> float:
    """Goodput (req/s) of a candidate: separable, one best value per knob, int4 best but refused below."""
    g = 1.0
    g *= {"none": 1.0, "int8": 1.5, "int4": 1.8}[params["quantization"]]
    g *= {1: 1.0, 2: 1.3}[params["replicas"]]
    g *= {8: 0.7, 16: 0.9, 32: 1.1, 64: 1.0, 128: 0.95, 256: 0.9}[params["max_num_seqs"]]
    g *= 1.1 if params["max_num_batched_tokens"] == 256 else 1.0
    g *= 0.9 if params["dtype"] == "float32" else 1.0
    g *= 0.95 if params["speculative_ngram"] else 1.0
    g *= 1.0 if params["enable_prefix_caching"] else 0.97
    g *= 1.02 if params["kv_cache_dtype"] == "int8" else 1.0
    return g


class FakeMeasure:
    """Each measurement takes 100 s of a fake clock and returns the landscape's figures; int4 is refused."""

    def __init__(self, clock: list[float], noise=None) -> None:
        self.clock, self.calls, self.tags, self.noise = clock, [], [], noise

    def search_calls(self) -> list[dict]:
        return [p for p, t in zip(self.calls, self.tags) if not t.startswith("confirm")]

    def __call__(self, params: dict, tag: str) -> dict:
        self.calls.append(dict(params))
        self.tags.append(tag)
        self.clock[0] += 100.0
        refused = params["quantization"] == "int4"
        g = 0.0 if refused else landscape(params) * (self.noise(params, tag) if self.noise else 1.0)
        probe = {"rate": g, "goodput": g, "ttft_p95": 500.0, "tpot_p95": 50.0, "broken": [], "kv_usage_max": 0.2}
        return {
            "goodput": g,
            "rate": g,
            "best": None if refused else probe,
            "fail": None,
            "probes": [] if refused else [probe],
            "refused": refused,
            "quality": {"agreement": 0.5 if refused else 0.99, "logprob_diff": 0.1, "positions": 10},
            "seconds": 100.0,
        }


def optimum(sp: space.Space) -> float:
    import itertools

    best = 0.0
    for combo in itertools.product(*sp.choices.values()):
        p = dict(zip(sp.choices, combo))
        if p["quantization"] != "int4":
            best = max(best, landscape(p))
    return best


def run_tuner(tmp_path, budget: float, clock: list[float], measure=None, sampler="tpe", sp=None, **kw):
    sp = sp or make_space()
    measure = measure or FakeMeasure(clock)
    t = Tuner(
        sp,
        measure,
        BOUNDS,
        f"sqlite:///{tmp_path / 'tune.db'}",
        "s",
        budget,
        sampler=sampler,
        clock=lambda: clock[0],
        log=lambda s: None,
        estimate_s=100.0,
        **kw,
    )
    return t, t.run(), measure


def test_space_is_derived_from_model_and_machine():
    sp = make_space()
    assert sp.choices["replicas"] == [1, 2]
    assert "bfloat16" in sp.choices["dtype"] and sp.defaults["dtype"] == "bfloat16"
    assert sp.defaults["max_num_batched_tokens"] in sp.choices["max_num_batched_tokens"]
    no_bf16 = space.derive(2 * 10**8, 46080, 700, cores=4, bf16=False, max_replicas=2)
    assert no_bf16.choices["dtype"] == ["float32"] and no_bf16.choices["replicas"] == [1, 2]
    # a model whose KV cache holds few requests gets no large max_num_seqs
    big_kv = space.derive(2 * 10**9, 8 * 2**20, 2000, cores=2, bf16=False)
    assert max(big_kv.choices["max_num_seqs"]) <= 64 and big_kv.notes
    # w8a8 (one-level int8 activations) only where the CPU sums int8 products itself; never on CUDA
    assert "w8a8" not in no_bf16.choices["quantization"]
    assert space.derive(2 * 10**8, 46080, 700, cores=2, bf16=True, int8_dots=True).choices["quantization"] == [
        "none",
        "int8",
        "int4",
        "w8a8",
    ]
    assert (
        "w8a8"
        not in space.derive(2 * 10**8, 46080, 700, cores=2, bf16=True, device="cuda", int8_dots=True).choices[
            "quantization"
        ]
    )


def test_step_targets_are_derived_from_the_slo():
    """A stream's TPOT is the mean of the steps it waits through: the step-time targets searched are the SLO's gap
    bound and twice it, beside the CPU default; the pick reaches serve as --max-step-ms; CUDA has no target."""
    sp = space.derive(2 * 10**9, 46080, 700, cores=2, bf16=True, step_bound_ms=100)
    assert sp.choices["max_step_ms"] == [100, 200, 850] and sp.defaults["max_step_ms"] == 850
    argv = space.serve_argv({**sp.defaults, "max_step_ms": 200}, 2)
    assert argv[argv.index("--max-step-ms") + 1] == "200"
    assert any(m["max_step_ms"] == 100 for m in sp.moves(sp.defaults))
    loose = space.derive(2 * 10**9, 46080, 700, cores=2, bf16=True, step_bound_ms=800)
    assert loose.choices["max_step_ms"] == [800, 850]  # twice the bound is over the default: not a tighter target
    assert make_space().choices["max_step_ms"] == [850]  # no gap bound in the SLO: the default only
    cuda = space.derive(2 * 10**9, 46080, 700, cores=2, bf16=True, device="cuda", step_bound_ms=100)
    assert cuda.choices["max_step_ms"] == [0]


@pytest.mark.parametrize("blocks", ["1", "0"])
def test_a_quantized_gguf_is_tuned_from_what_serve_runs(monkeypatch, blocks):
    """The bundled model is a Q4_1 GGUF: `llmserve serve` runs its own blocks (--quantization auto -> gguf) with
    float32 around them, so the tuner's defaults are that, and the YAML of the defaults says so; with
    LLMSERVE_GGUF_BLOCKS=0 (auto widens the blocks) they are the float weights' defaults again."""
    monkeypatch.setenv("LLMSERVE_GGUF_BLOCKS", blocks)
    sp = space.for_model(None, 700)
    if blocks == "0":
        assert "gguf" not in sp.choices["quantization"] and sp.defaults["quantization"] == "none"
        return
    assert sp.choices["quantization"][0] == "gguf" and sp.defaults["quantization"] == "gguf"
    assert sp.defaults["dtype"] == "float32" and any("Q4_1" in n for n in sp.notes)
    argv = space.serve_argv(sp.defaults, 2)
    assert argv[argv.index("--quantization") + 1] == "gguf" and argv[argv.index("--dtype") + 1] == "float32"
    assert space.changes_answers(sp.defaults)  # the quality guard measures the file's blocks against float32
    # the step to float weights is taken with --dtype auto's choice (bfloat16 here), never float32-exact first
    widened = [m for m in sp.moves(sp.defaults) if m["quantization"] == "none"]
    expected = "bfloat16" if "bfloat16" in sp.choices["dtype"] else "float32"
    assert len(widened) == 1 and widened[0]["dtype"] == expected


def test_search_finds_the_optimum_within_budget(tmp_path):
    clock = [0.0]
    tuner, out, measure = run_tuner(tmp_path, 3000.0, clock)
    assert len(measure.calls) <= 30  # the budget: 30 measurements of 100 s
    assert out.best["result"]["goodput"] == pytest.approx(optimum(out.space))
    assert measure.calls[0] == out.space.defaults  # the defaults first, the baseline
    # int4 was refused by the (fake) guard, and its answer-changing twin pruned rather than measured
    assert all(m["params"]["quantization"] != "int4" or m["result"]["refused"] for m in out.measured)
    assert out.best["params"]["quantization"] == "int8"


def test_grid_sampler_also_runs(tmp_path):
    clock = [0.0]
    _, out, measure = run_tuner(tmp_path, 1000.0, clock, sampler="grid")
    assert 1 <= len(measure.calls) <= 10 and out.best


def test_resumed_run_measures_nothing_twice(tmp_path):
    clock = [0.0]
    _, first, m1 = run_tuner(tmp_path, 800.0, clock)
    # 5 candidates (the time of a 3-member round reserved), then the 2 best re-measured (the defaults among them)
    assert len(m1.search_calls()) == 5 and len(m1.calls) == 7
    assert first.confirmation.members[-1] == 0 or 0 in first.confirmation.members
    tuner, second, m2 = run_tuner(tmp_path, 800.0, clock)
    assert tuner.resumed == 5
    keys1 = {first.space.key(p) for p in m1.search_calls()}
    keys2 = [second.space.key(p) for p in m2.search_calls()]
    assert len(keys2) == 5 and not keys1 & set(keys2) and len(set(keys2)) == len(keys2)
    assert len(second.measured) == 10
    assert second.best["result"]["goodput"] >= first.best["result"]["goodput"]
    # the resumed search found better candidates: a new round (numbered 2) re-measured the new top two, and the
    # defaults (trial 0) beside them, last
    assert second.confirmation.number == 2 and all(t.startswith("confirm-r2-") for t in m2.tags[5:])
    assert len(second.confirmation.members) == 3 and second.confirmation.members[-1] == 0


def test_grid_points_are_measured_first(tmp_path):
    clock = [0.0]
    sp = make_space()
    _, out, measure = run_tuner(tmp_path, 1500.0, clock, grid_points=4)
    seeds = space.grid_seeds(sp, 4)
    assert measure.calls[:4] == seeds and seeds[0] == sp.defaults
    # the corners around the defaults: the largest chunk budget, the largest max-num-seqs, both
    assert [(p["max_num_seqs"], p["max_num_batched_tokens"]) for p in seeds[1:]] == [
        (64, 1024),
        (256, 512),
        (256, 1024),
    ]
    assert all(p["replicas"] == 1 and p["quantization"] == "none" for p in seeds)


def knobs_space(*keep: str) -> space.Space:
    """The space `--knobs` leaves: the other knobs at their defaults."""
    sp = make_space()
    sp.choices = {k: (v if k in keep else [sp.defaults[k]]) for k, v in sp.choices.items()}
    return sp


def flattered_once(params: dict, tag: str) -> float:
    """max_num_seqs 256 x 1024 tokens measured during a passing lull: 1.5x its figure, its first time only."""
    corner = params["max_num_seqs"] == 256 and params["max_num_batched_tokens"] == 1024
    return 1.5 if corner and not tag.startswith("confirm") else 1.0


@pytest.mark.parametrize("confirm", [0, 2, 3])
def test_confirmation_round_picks_the_true_best_over_a_flattered_one(tmp_path, confirm):
    clock = [0.0]
    sp = knobs_space("max_num_seqs", "max_num_batched_tokens")
    fake = FakeMeasure(clock, noise=flattered_once)
    _, out, _ = run_tuner(tmp_path, 1000.0, clock, measure=fake, sp=sp, confirm=confirm)
    flattered = {**sp.defaults, "max_num_seqs": 256, "max_num_batched_tokens": 1024}
    assert any(m["params"] == flattered for m in out.measured)
    first = max(out.measured, key=lambda m: m["result"]["goodput"])
    assert first["params"] == flattered  # on the single figures, the flattered corner leads
    true_best = max(out.measured, key=lambda m: landscape(m["params"]))
    if confirm < 2:
        assert out.confirmation is None and out.best["params"] == flattered
        return
    assert fake.clock[0] <= 1000.0  # the round's time was reserved from the budget
    rounds = [t for t in fake.tags if t.startswith("confirm")]
    assert len(rounds) >= confirm and out.confirmation.passes() >= 1
    assert out.best["params"] == true_best["params"] != flattered
    assert out.best["confirmed"] == pytest.approx(landscape(true_best["params"]))
    # back to back: nothing else was measured between the round's first and last re-measurement
    assert all(t.startswith("confirm") for t in fake.tags[fake.tags.index(rounds[0]) :])
    # the report shows both figures of every member: the flattered corner's 1.35 first, 0.9 re-measured
    from llmserve.tune import report

    md = report.markdown(out, BOUNDS, {"workload": "w", "budget": "1000s"}, None, None)
    row = next(
        line
        for line in md.splitlines()
        if line.startswith("| ") and "max_num_seqs=256, max_num_batched_tokens=1024 | 1.35 |" in line
    )
    assert "Confirmation round 1 (1 complete pass" in md and "| 0.9 | 0.9 |" in row
    assert "first figure" in md.split("**Chosen**")[1].splitlines()[0]


def test_the_defaults_are_confirmed_beside_the_best(tmp_path):
    """Every candidate but the defaults is worse (0.8x), yet each measures 1.3x on its first figure: the round
    re-measures the defaults beside the two best first figures, and the defaults are chosen."""
    clock = [0.0]
    sp = knobs_space("max_num_seqs", "max_num_batched_tokens")

    def flattered_all(params, tag):
        return 1.0 if params == sp.defaults else (0.8 if tag.startswith("confirm") else 1.3) / landscape(params)

    _, out, _ = run_tuner(tmp_path, 1000.0, clock, measure=FakeMeasure(clock, noise=flattered_all), sp=sp)
    first = max(out.measured, key=lambda m: m["result"]["goodput"])
    assert first["params"] != sp.defaults and len(out.confirmation.members) == 3
    assert out.best["params"] == sp.defaults and out.best["confirmed"] == pytest.approx(landscape(sp.defaults))


def test_a_slow_last_candidate_delays_the_round_never_skips_it(tmp_path):
    clock = [0.0]
    sp = knobs_space("max_num_seqs", "max_num_batched_tokens")
    fake = FakeMeasure(clock, noise=flattered_once)

    def sixth_slow(params, tag):
        result = fake(params, tag)
        if len(fake.calls) == 6:  # a load spike: started with the round's time left, it ran 3x as long
            clock[0] += 200.0
            result["seconds"] = 300.0
        return result

    _, out, _ = run_tuner(tmp_path, 900.0, clock, measure=sixth_slow, sp=sp, confirm=2)
    assert len(fake.search_calls()) == 6 and out.confirmation and out.confirmation.passes() == 1
    assert out.best["params"] != {**sp.defaults, "max_num_seqs": 256, "max_num_batched_tokens": 1024}
    assert clock[0] == 1000.0  # past the 900 s budget by the slow candidate's extra time, not more


def test_confirmation_is_resumed_not_measured_again(tmp_path):
    clock = [0.0]
    sp = knobs_space("max_num_seqs", "max_num_batched_tokens")
    fake = FakeMeasure(clock, noise=flattered_once)
    calls = []

    def interrupted_in_round(params, tag):
        calls.append(tag)
        if tag.startswith("confirm") and sum(t.startswith("confirm") for t in calls) == 2:
            raise KeyboardInterrupt  # the round's second re-measurement
        return fake(params, tag)

    _, out, _ = run_tuner(tmp_path, 1000.0, clock, measure=interrupted_in_round, sp=sp, confirm=2)
    assert out.interrupted and out.confirmation.passes() == 0 and len(out.confirmation.records) == 1
    assert out.best["params"]["max_num_seqs"] == 256  # an incomplete round: the first figures decide
    searched = len(fake.search_calls())
    # resumed with the time of the round (two measurements) but not of a candidate beside it: only the round's
    # missing member is measured
    tuner, out, _ = run_tuner(tmp_path, 200.0, clock, measure=fake, sp=sp, confirm=2)
    assert tuner.resumed == searched and len(fake.search_calls()) == searched
    assert [t.startswith("confirm-r1-p0-") for t in fake.tags[-1:]] == [True] and len(fake.tags) == searched + 2
    assert out.confirmation.number == 1 and out.confirmation.passes() == 1 and out.confirmation.reused == 1
    assert out.best["params"] != {**sp.defaults, "max_num_seqs": 256, "max_num_batched_tokens": 1024}
    # resumed again: the round is complete, nothing is measured
    n = len(fake.calls)
    _, again, _ = run_tuner(tmp_path, 0.0, clock, measure=fake, sp=sp, confirm=2)
    assert len(fake.calls) == n and again.best["params"] == out.best["params"]


def test_slo_nothing_meets_names_closest_and_percentile(tmp_path):
    clock = [0.0]

    def measure(params, tag):
        clock[0] += 100.0
        tpot = 300.0 if params["quantization"] == "none" else 150.0  # int8 comes closer; TPOT always fails
        probe = {"rate": 0.1, "goodput": 0.0, "ttft_p95": 900.0, "tpot_p95": tpot, "broken": [f"tpot_p95 {tpot}"]}
        return {"goodput": 0.0, "rate": 0.0, "best": None, "fail": probe, "probes": [probe], "seconds": 100.0}

    _, out, _ = run_tuner(tmp_path, 500.0, clock, measure=measure)
    assert out.best is None
    c = out.closest(BOUNDS)
    assert c["params"]["quantization"] != "none" and c["failed"] == ["tpot_p95"]
    args = types.SimpleNamespace(users=None, think_time=10.0, rate=None, model=None, budget="500s")
    rdir = tmp_path / "r"
    rdir.mkdir()
    console = types.SimpleNamespace(printed=[])
    console.print = lambda s, **k: console.printed.append(s)
    rc = cli.finish(args, out, BOUNDS, types.SimpleNamespace(label="w"), 500, rdir, tmp_path / "t.yaml", 0, console)
    assert rc == 3 and not (tmp_path / "t.yaml").exists()
    assert "closest" in console.printed[-1] and "tpot_p95" in console.printed[-1]
    assert "No candidate met the SLO" in (rdir / "report.md").read_text()


def test_pruning_rules_read_the_engine_metrics():
    sp = make_space()
    d = sp.defaults
    full = {"probes": [{"rate": 1, "kv_usage_max": 1.0, "preemptions": 3}], "goodput": 1.0}
    measured = [{"params": {**d, "max_num_seqs": 32}, "result": full}]
    assert prune_rule({**d, "max_num_seqs": 64}, measured, BOUNDS).startswith("kv")
    assert prune_rule({**d, "max_num_seqs": 16}, measured, BOUNDS) is None
    ttft_broke = {"probes": [], "goodput": 1.0, "fail": {"broken": ["ttft_p95 2500 ms > 2000"], "ttft_p95": 2500}}
    measured = [{"params": {**d, "max_num_batched_tokens": 256}, "result": ttft_broke}]
    assert prune_rule({**d, "max_num_batched_tokens": 128}, measured, BOUNDS).startswith("ttft")
    assert prune_rule({**d, "max_num_batched_tokens": 512}, measured, BOUNDS) is None
    refused = {"probes": [], "goodput": 0.0, "refused": True}
    measured = [{"params": {**d, "quantization": "int4"}, "result": refused}]
    assert prune_rule({**d, "quantization": "int4", "replicas": 2}, measured, BOUNDS).startswith("quality")


def test_rate_search_bisects_to_where_the_slo_breaks():
    capacity = 3.0  # the SLO holds up to 3 req/s

    async def probe(rate):
        ok = rate <= capacity
        return {
            "completed": 20,
            "failed": 0,
            "goodput": min(rate, capacity) * 0.95,
            "ttft_ms": {"p95": 500 if ok else 5000},
            "tpot_ms": {"p95": 50},
        }

    found = asyncio.run(rate_search(probe, BOUNDS, 0.5, max_probes=8, tol=1.1))
    assert 3.0 / 1.1 <= found["rate"] <= 3.0
    assert found["fail"]["rate"] > 3.0 and "ttft_p95" in found["fail"]["broken"][0]


def test_rate_search_stops_at_the_probes_ceiling():
    """A server that drains any burst within the SLO (a finite probe cannot load it past its capacity) is reported
    at the ceiling, flagged, never at a burst rate hundreds of times its capacity."""
    rates = []

    async def probe(rate):
        rates.append(rate)
        return {"completed": 20, "failed": 0, "goodput": 1.5, "ttft_ms": {"p95": 300}, "tpot_ms": {"p95": 80}}

    found = asyncio.run(rate_search(probe, BOUNDS, 1.0, max_probes=8, max_rate=6.4))
    assert rates == [1.0, 2.0, 4.0, 6.4] and found["ceiling"] and found["rate"] == 6.4
    unbounded = asyncio.run(rate_search(probe, BOUNDS, 1.0, max_probes=3))
    assert not unbounded["ceiling"] and unbounded["rate"] == 4.0
    assert unbounded["open"] and not found["open"]  # the probes ran out before the SLO broke: a lower bound


def test_rate_search_climbs_faster_far_from_the_slo():
    """Every percentile under half its bound: the rate quadruples (fewer probes to find a fast server's range);
    near a bound it doubles."""
    rates = []

    async def probe(rate):
        rates.append(rate)
        ok = rate <= 3.0
        tpot = 20 if rate < 1 else 80  # BOUNDS: tpot_p95 <= 100
        return {"completed": 20, "failed": 0, "goodput": rate, "ttft_ms": {"p95": 300 if ok else 5000},
                "tpot_ms": {"p95": tpot}}  # fmt: skip

    found = asyncio.run(rate_search(probe, BOUNDS, 0.1, max_probes=6, tol=1.2))
    assert rates[:4] == [0.1, 0.4, 1.6, 3.2]
    assert 3.0 / 1.2 <= found["rate"] <= 3.0 and not found["ceiling"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--slo", "latency_p95=100"], "unknown key 'latency_p95'"),
        (["--slo", "ttft_p95=2000", "--budget", "10s"], "too small for one candidate"),
        (["--slo", "ttft_p95=2000", "--budget", "soon"], "not a duration"),
        (["--slo", "ttft_p95=2000", "--workload", "BAD"], "line 2 does not parse"),
        (["--slo", "ttft_p95=2000", "--confirm", "-1"], "--confirm >= 0"),
        (["--slo", "ttft_p95=2000", "--grid-points", "0"], "--grid-points must be >= 1"),
        (["--slo", "ttft_p95=2000", "--max-requests", "2"], "--max-requests must be >= 6"),
    ],
)
def test_bad_input_is_refused_before_any_server(tmp_path, capsys, argv, message):
    bad = tmp_path / "log.jsonl"
    bad.write_text('{"prompt": "hi", "max_tokens": 8, "arrival": 0}\n{not json\n')
    argv = [str(bad) if a == "BAD" else a for a in argv]
    from llmserve.cli import main

    assert main(["tune", *argv, "--port", "1"]) == 2  # port 1: a server start would fail loudly
    assert message in capsys.readouterr().err


def test_rate_search_gives_up_on_a_worse_candidate():
    rates = []

    async def probe(rate):
        rates.append(rate)
        return {"completed": 20, "failed": 0, "goodput": 0.1, "ttft_ms": {"p95": 5000}, "tpot_ms": {"p95": 50}}

    found = asyncio.run(rate_search(probe, BOUNDS, 1.0, max_probes=5, lose_fast=True))
    assert rates == [1.0, 0.5] and found["goodput"] == 0.0 and found["fail"]["rate"] == 0.5


def test_ctrl_c_keeps_what_was_measured_and_a_resume_starts_from_the_defaults(tmp_path):
    clock = [0.0]
    fake = FakeMeasure(clock)

    def interrupted_first(params, tag):
        raise KeyboardInterrupt

    _, out, _ = run_tuner(tmp_path, 500.0, clock, measure=interrupted_first)
    assert out.interrupted and not out.measured
    _, out, measure = run_tuner(tmp_path, 300.0, clock, measure=fake)
    assert measure.calls[0] == out.space.defaults and len(out.measured) == 3

    def interrupted_third(params, tag):
        if len(fake.calls) == 4:
            raise KeyboardInterrupt
        return fake(params, tag)

    _, out, _ = run_tuner(tmp_path, 1000.0, clock, measure=interrupted_third)
    assert out.interrupted and len(out.measured) == 4 and out.best  # the best so far, the earlier ones kept


def test_tuned_yaml_with_replicas_is_read_by_launch_and_serve(tmp_path, capsys):
    import argparse

    from llmserve.router import launch
    from llmserve.serve_config import add_serve_arguments
    from llmserve.server.cli import _apply_config_file

    sp = make_space()
    params = {**sp.defaults, "replicas": 2, "quantization": "int8"}
    path = tmp_path / "tuned.yaml"
    from llmserve.tune import report

    report.write_yaml(path, params, 2, None, ["test"])
    p = argparse.ArgumentParser()
    launch.add_arguments(p)
    args = p.parse_args(["--config", str(path)])
    launch.apply_fleet_config(args, set())
    assert args.replicas == 2 and args.num_threads == 2
    cmds = launch.replica_commands(args, args.replicas, 9000)
    assert all("--config" in c and c[c.index("--num-threads") + 1] == "1" for c in cmds)
    s = argparse.ArgumentParser()
    add_serve_arguments(s)
    sargs = s.parse_args(["--config", str(path)])
    _apply_config_file(sargs, set())  # replicas: noted, one server; the rest read
    assert sargs.quantization == "int8" and sargs.num_threads == 2
    assert "starts one" in capsys.readouterr().err


def test_request_log_is_replayed_in_its_order_and_sped_up(tmp_path):
    import time

    from llmserve.bench.client import RequestRecord
    from llmserve.bench.loadgen import LoadPhase, run_phase
    from llmserve.tune.workload import read_log

    log = tmp_path / "log.jsonl"
    log.write_text(
        '{"prompt": "c", "max_tokens": 4, "arrival": 10.4}\n'
        '{"messages": [{"role": "user", "content": "a"}], "max_tokens": 8, "arrival": 10.0}\n'
        '{"prompt": "b", "max_tokens": 4, "offset": 10.2}\n'
    )
    reqs = read_log(str(log))
    assert [r.prompt for r in reqs] == ["a", "b", "c"] and reqs[0].arrival == 0.0 and reqs[0].messages

    class Recorder:  # the client's interface: what loadgen calls, and when
        sent: list = []

        async def send(self, req, index, on_chunk=None):
            self.sent.append((req.prompt, time.perf_counter()))
            return RequestRecord(index=index, prompt_len=1, max_tokens=req.output_len, success=True)

    client = Recorder()
    run = asyncio.run(run_phase(client, LoadPhase("replay", 2.0, 3), reqs))
    assert [p for p, _ in client.sent] == ["a", "b", "c"] and len(run.records) == 3
    assert client.sent[2][1] - client.sent[0][1] >= 0.19  # 0.4 s of log at 2x: 0.2 s
