"""Engine behaviour with the real bundled model: continuous batching, seeds, bad input, n, stops."""

from __future__ import annotations

import pytest

from llmserve import SamplingParams
from llmserve.engine.request import RequestStatus


def chat_ids(llm, text):
    return llm.get_tokenizer().encode_chat([{"role": "user", "content": text}])


def test_new_request_joins_running_batch(llm):
    eng = llm.engine
    steps = []
    orig = eng.executor.execute

    def spy(sched, **kw):
        steps.append(dict(sched.num_scheduled_tokens))
        return orig(sched, **kw)

    eng.executor.execute = spy
    try:
        p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        a = eng.add_request(chat_ids(llm, "Tell me about dragons."), p)
        b = eng.add_request(chat_ids(llm, "Tell me about castles."), p)
        done: dict[str, int] = {}
        first_token: dict[str, int] = {}
        step = 0
        late = None
        while eng.has_unfinished_requests():
            step += 1
            if step == 5:
                late = eng.add_request(
                    chat_ids(llm, "Write a long poem about the sea and the wind. " * 8),
                    SamplingParams(temperature=0, max_tokens=5),
                )
            for out in eng.step():
                if out.outputs[0].delta_token_ids:
                    first_token.setdefault(out.request_id, step)
                if out.finished:
                    done[out.request_id] = step
        assert first_token[late] < done[a] and first_token[late] < done[b]
        # some step ran the late request's prompt (several tokens) together with decodes (one token each)
        assert any(s.get(late, 0) > 1 and s.get(a) == 1 and s.get(b) == 1 for s in steps), steps
    finally:
        eng.executor.execute = orig


def test_seeded_request_same_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    prompt = chat_ids(llm, "Invent a name for a cat.")
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].text
    others = [chat_ids(llm, f"Say something about the number {i}.") for i in range(16)]
    params = [SamplingParams(temperature=0.5 + i / 20, max_tokens=10 + i) for i in range(16)]
    outs = llm.generate(others[:8] + [prompt] + others[8:], params[:8] + [seeded] + params[8:], use_tqdm=False)
    assert outs[8].outputs[0].text == alone
    again = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].text
    assert again == alone


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda llm: llm.generate([""], SamplingParams(max_tokens=4), use_tqdm=False), "prompt"),
        (
            lambda llm: llm.generate(
                [[1] * (llm.engine.max_model_len + 5)], SamplingParams(max_tokens=4), use_tqdm=False
            ),
            "prompt",
        ),
        (lambda llm: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda llm: SamplingParams(top_p=0.0), "top_p"),
        (lambda llm: SamplingParams(top_p=1.5), "top_p"),
        (lambda llm: SamplingParams(temperature=-0.5), "temperature"),
        (lambda llm: llm.generate([[10**9]], SamplingParams(max_tokens=4), use_tqdm=False), "prompt"),
        (lambda llm: llm.generate(["Hi"], SamplingParams(logit_bias={10**9: 5}), use_tqdm=False), "logit_bias"),
        (lambda llm: llm.generate(["Hi"], SamplingParams(logprobs=21), use_tqdm=False), "logprobs"),
        (lambda llm: llm.generate(["Hi"], SamplingParams(prompt_logprobs=50), use_tqdm=False), "prompt_logprobs"),
    ],
)
def test_bad_input_is_a_clear_value_error(llm, make, field):
    with pytest.raises(ValueError) as e:
        make(llm)
    assert str(e.value).startswith(field), str(e.value)
    # and the engine keeps serving
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_unknown_model_path():
    from llmserve import LLM

    with pytest.raises(ValueError) as e:
        LLM(model="/nonexistent/model/dir")
    assert str(e.value).startswith("model")


def test_too_long_prompt_message_names_the_limit(llm):
    with pytest.raises(ValueError) as e:
        llm.generate([[5] * llm.engine.max_model_len], SamplingParams(max_tokens=1), use_tqdm=False)
    assert str(llm.engine.max_model_len) in str(e.value)


def test_n_stop_logprobs_and_finish_reasons(llm):
    prompt = chat_ids(llm, "List the days of the week.")
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    words = greedy.text.split()
    stop = words[2]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)[0].outputs[
        0
    ]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == greedy.text[: greedy.text.index(stop)]
    lp = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(lp.logprobs) == 5
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert entry.token_id == tok and entry.logprob <= 0
        assert entry.top[0].token_id == tok  # greedy picks the most likely token
    stop_tok = greedy.token_ids[3]
    st = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]), use_tqdm=False
    )[0].outputs[0]
    assert st.finish_reason == "stop" and st.stop_reason == stop_tok and st.token_ids == greedy.token_ids[:4]
    mt = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, min_tokens=29, ignore_eos=False), use_tqdm=False
    )[0].outputs[0]
    assert len(mt.token_ids) >= 29


def test_abort_frees_blocks(llm):
    eng = llm.engine
    rid = eng.add_request(chat_ids(llm, "Tell me a story." * 30), SamplingParams(max_tokens=50))
    eng.step()
    assert eng.kv.num_free_blocks < eng.num_blocks
    out = eng.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.kv.num_free_blocks == eng.num_blocks
    assert not eng.has_unfinished_requests()
    assert RequestStatus.FINISHED_ABORTED.finished


def test_full_queue_raises_typed_error_engine_keeps_serving(llm):
    from llmserve.engine.scheduler import QueueFullError

    eng = llm.engine
    seqs = eng.scheduler.max_num_seqs
    eng.scheduler.max_queued_requests, eng.scheduler.max_num_seqs = 1, 1
    try:
        # one to run (the free slot), one to wait: the third is refused
        a = eng.add_request(chat_ids(llm, "One"), SamplingParams(temperature=0, max_tokens=3))
        b = eng.add_request(chat_ids(llm, "Two"), SamplingParams(temperature=0, max_tokens=3))
        with pytest.raises(QueueFullError):
            eng.add_request(chat_ids(llm, "Three"), SamplingParams(temperature=0, max_tokens=3))
        finished = set()
        while eng.has_unfinished_requests():
            finished |= {o.request_id for o in eng.step() if o.finished}
        assert finished == {a, b}
        assert eng.kv.num_free_blocks == eng.num_blocks
    finally:
        eng.scheduler.max_queued_requests, eng.scheduler.max_num_seqs = None, seqs


def test_fault_in_one_request_fails_it_alone(llm):
    eng = llm.engine
    bad = {}

    def hook(req):
        if req.request_id == bad.get("id") and req.num_output_tokens == 2:
            raise RuntimeError("injected sampler fault")

    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    good = [eng.add_request(chat_ids(llm, f"Say {i}."), p) for i in range(3)]
    bad["id"] = eng.add_request(chat_ids(llm, "Fail me."), p)
    eng.fault_hook = hook
    try:
        finals = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    finals[o.request_id] = o
    finally:
        eng.fault_hook = None
    assert finals[bad["id"]].error and "injected" in finals[bad["id"]].error
    assert finals[bad["id"]].outputs[0].finish_reason == "error"
    for g in good:
        assert finals[g].error is None and len(finals[g].outputs[0].token_ids) == 6
    assert eng.kv.num_free_blocks == eng.num_blocks


def test_logit_bias_bans_and_forces_tokens_in_a_batch(llm):
    """-100 keeps a token out of greedy and sampled output, +100 makes it every token; the rows batched with
    them (greedy, on the fast paths) are untouched."""
    prompts = [chat_ids(llm, f"Count from {i} to {i + 9}.") for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    top = max(set(plain[0]), key=plain[0].count)  # a token the greedy answer uses
    ban = {top: -100}
    params = [
        greedy.clone(logit_bias=ban),
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logit_bias=ban),
        greedy.clone(logit_bias={42: 100}),
        greedy,
    ]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert top not in outs[0] and outs[0] != plain[0]
    assert top not in outs[1]
    assert outs[2] == [42] * 12
    assert outs[3] == plain[3]
