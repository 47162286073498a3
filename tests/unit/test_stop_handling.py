"""Stop handling without a model: `Scheduler.update_from_output` (EOS, stop token ids, max_tokens,
max_model_len, speculative rollback) and the `OutputProcessor` (detokenizing, stop strings), driven with
hand-picked "sampled" tokens and a tokenizer whose tokens are fixed text pieces."""

from __future__ import annotations

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.outputs import SampledTokens
from llmserve.engine.request import Request, SamplingParams, TokenLogprobs
from llmserve.engine.scheduler import Scheduler

EOS = 100
PIECES = {1: "<s>", 2: "Say", 3: ":", 10: "Hel", 11: "lo", 12: " wo", 13: "rld", 14: "!", 15: " again", EOS: "</s>"}
SPECIAL = {1, EOS}


class PieceTokenizer:
    """Token i is the text PIECES[i]; 1 and EOS are special."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i in SPECIAL))


class Harness:
    """Scheduler + output processor; `step` plays the runner: it hands out the given sampled tokens."""

    def __init__(self, max_model_len=64):
        self.sched = Scheduler(
            KVCacheManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=max_model_len
        )
        self.proc = OutputProcessor(PieceTokenizer())
        self.outputs: dict[str, list] = {}

    def add(self, params, rid="r", prompt=(1, 2, 3)):
        req = Request(rid, list(prompt), params, {EOS})
        self.sched.add_request(req)
        self.proc.add_request(req)
        self.outputs[rid] = []
        return req

    def step(self, tokens: dict[str, list[int]], proposals: dict[str, list[int]] | None = None, **kw):
        for rid, spec in (proposals or {}).items():
            self.sched.requests[rid].spec_token_ids = list(spec)
        out = self.sched.schedule()
        sampled = [SampledTokens(r, tokens[r.request_id], **kw) for r in out.requests if r.request_id in tokens]
        text = self.proc.process(self.sched.update_from_output(out, sampled))
        self.sched.apply_text(text)  # as LLMEngine.step: the stop decisions, then the outputs
        for o in self.proc.outputs(text):
            self.outputs[o.request_id].append(o)

    def run(self, params, tokens, **add):
        """One request, one sampled token per step, until it finishes."""
        req = self.add(params, **add)
        for t in tokens:
            if req.is_finished:
                break
            self.step({req.request_id: [t]})
        assert req.is_finished
        return req, self.final(req.request_id)

    def final(self, rid):
        outs = self.outputs[rid]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        comp = outs[-1].outputs[0]
        # streamed deltas add up to the final text and tokens
        assert "".join(o.outputs[0].delta_text for o in outs) == comp.text
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == comp.token_ids
        return comp


def test_stop_string_across_token_boundaries():
    h = Harness()
    req, c = h.run(SamplingParams(max_tokens=10, stop=["o wor"]), [10, 11, 12, 13, 14])
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hell", "stop", "o wor")
    assert c.token_ids == [10, 11, 12, 13]  # up to the token that completed the stop string
    assert h.sched.kv.num_free_blocks == 32 and not h.sched.has_unfinished()
    assert not h.proc.detokenizers


def test_include_stop_str_in_output():
    _, c = Harness().run(
        SamplingParams(max_tokens=10, stop=["o wor"], include_stop_str_in_output=True), [10, 11, 12, 13, 14]
    )
    assert (c.text, c.stop_reason) == ("Hello wor", "o wor")


def test_text_that_may_start_a_stop_string_is_held_back():
    h = Harness()
    req = h.add(SamplingParams(max_tokens=10, stop=["lo!"]))
    for t in (10, 11):
        h.step({"r": [t]})
    assert "".join(o.outputs[0].delta_text for o in h.outputs["r"]) == "Hel"  # "lo" may start "lo!"
    for t in (12, 13, 14):
        h.step({"r": [t]})
    assert not req.is_finished  # "Hello world!" never contains "lo!"
    assert h.outputs["r"][-1].outputs[0].text == "Hello worl"
    h.step({"r": [EOS]})
    assert h.final("r").text == "Hello world!"  # the end releases what was held back


def test_stop_token_ids_keep_the_token_and_its_text():
    _, c = Harness().run(SamplingParams(max_tokens=10, stop_token_ids=[12]), [10, 11, 12, 13])
    assert (c.token_ids, c.finish_reason, c.stop_reason, c.text) == ([10, 11, 12], "stop", 12, "Hello wo")


def test_eos_stops_without_text_and_not_before_min_tokens():
    _, c = Harness().run(SamplingParams(max_tokens=10), [10, EOS, 11])
    assert (c.token_ids, c.finish_reason, c.stop_reason, c.text) == ([10, EOS], "stop", None, "Hel")
    _, c = Harness().run(SamplingParams(max_tokens=10, min_tokens=3), [10, EOS, 11, EOS, 12])
    assert (c.token_ids, c.finish_reason, c.text) == ([10, EOS, 11, EOS], "stop", "Hello")
    _, c = Harness().run(SamplingParams(max_tokens=4, ignore_eos=True), [EOS, EOS, 10, EOS])
    assert (c.token_ids, c.finish_reason) == ([EOS, EOS, 10, EOS], "length")


def test_max_tokens_and_max_model_len():
    _, c = Harness().run(SamplingParams(max_tokens=3), [10, 11, 12, 13])
    assert (c.token_ids, c.finish_reason, c.stop_reason, c.text) == ([10, 11, 12], "length", None, "Hello wo")
    _, c = Harness(max_model_len=5).run(SamplingParams(max_tokens=None), [10, 11, 12, 13])
    assert (c.token_ids, c.finish_reason) == ([10, 11], "length")  # 3 prompt tokens + 2 = max_model_len


def test_a_stop_string_wins_over_length_at_the_same_token():
    _, c = Harness().run(SamplingParams(max_tokens=2, stop=["llo"]), [10, 11, 12])
    assert (c.token_ids, c.finish_reason, c.stop_reason, c.text) == ([10, 11], "stop", "llo", "He")


def test_speculative_run_verified_rejected_and_rolled_back():
    h = Harness()
    req = h.add(SamplingParams(max_tokens=10))
    h.step({"r": [10]})
    assert req.num_computed_tokens == 3
    # proposals 11, 99, 13: the model agrees with 11 only, then picks 12 (99 rejected)
    h.step({"r": [11, 12, 13, 14]}, proposals={"r": [11, 99, 13]})
    assert req.output_token_ids == [10, 11, 12]
    assert req.num_computed_tokens == req.num_tokens - 1  # KV valid up to the accepted proposal
    assert (h.sched.num_spec_proposed, h.sched.num_spec_accepted) == (3, 1)
    o = h.outputs["r"][-1].outputs[0]
    assert (o.delta_token_ids, o.delta_text) == ([11, 12], "lo wo")


def test_speculative_run_cut_by_a_stop_string_or_max_tokens():
    h = Harness()
    req = h.add(SamplingParams(max_tokens=10, stop=["lo w"], logprobs=0))
    h.step({"r": [10]}, logprobs=[TokenLogprobs(10, -0.5)])
    # every proposal verified; the stop string ends at the second token: the rest is dropped
    h.step(
        {"r": [11, 12, 13, 14]},
        proposals={"r": [11, 12, 13]},
        logprobs=[TokenLogprobs(t, -0.25) for t in (11, 12, 13, 14)],
    )
    c = h.final("r")
    assert (c.token_ids, c.text, c.stop_reason) == ([10, 11, 12], "Hel", "lo w")
    assert [lp.token_id for lp in c.logprobs] == [10, 11, 12] and c.cumulative_logprob == -1.0
    assert h.outputs["r"][-1].outputs[0].delta_logprobs == [TokenLogprobs(11, -0.25), TokenLogprobs(12, -0.25)]
    assert (h.sched.num_spec_proposed, h.sched.num_spec_accepted) == (3, 1)
    h = Harness()
    req = h.add(SamplingParams(max_tokens=3))
    h.step({"r": [10]})
    h.step({"r": [11, 12, 13, 14]}, proposals={"r": [11, 12, 13]})
    assert (req.output_token_ids, req.finish_reason) == ([10, 11, 12], "length")


def test_a_failing_request_fails_alone():
    h = Harness()
    bad, good = h.add(SamplingParams(max_tokens=3), "bad"), h.add(SamplingParams(max_tokens=3), "good")
    h.step({"bad": [10], "good": [10]})
    h.sched.fault_hook = lambda r: r is bad and r.num_output_tokens == 1 and 1 / 0
    h.step({"bad": [11], "good": [11]})
    h.sched.fault_hook = None
    h.step({"good": [12]})
    b = h.final("bad")
    assert (b.finish_reason, b.token_ids, b.text) == ("error", [10], "Hel")
    assert "ZeroDivisionError" in h.outputs["bad"][-1].error
    assert (h.final("good").token_ids, good.finish_reason) == ([10, 11, 12], "length")
    assert h.sched.kv.num_free_blocks == 32 and not h.proc.detokenizers
