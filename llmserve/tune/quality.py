"""The quality guard: a candidate that can change the answers (bfloat16, int8/int4 weights, an int8 KV cache) is
scored against the float32 model on the workload's prompts, and refused below --min-agreement.

The float32 server answers each prompt greedily (N tokens); that text, after the prompt, is the reference sequence.
Both servers then score the whole sequence in one prefill (vLLM's `prompt_logprobs`, teacher-forced): at every
answer position, the greedy agreement is whether the candidate's most likely token is float32's, and the logprob
difference is |candidate's - float32's| log-probability of the reference token. Teacher forcing keeps one early
flip from counting every later token as a disagreement.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass
class Scored:
    top: list[int]  # the most likely token at each answer position
    logprobs: list[float]  # the reference token's log-probability there


async def _tokenize(http: httpx.AsyncClient, **body) -> list[int]:
    r = await http.post("/tokenize", json=body)
    r.raise_for_status()
    return r.json()["tokens"]


async def _score(http: httpx.AsyncClient, model: str, ids: list[int], start: int) -> Scored:
    r = await http.post(
        "/v1/completions",
        json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1},
    )
    r.raise_for_status()
    plp = r.json()["choices"][0]["prompt_logprobs"]
    top, lps = [], []
    for pos in range(start, len(ids)):
        entry = {int(k): v for k, v in (plp[pos] or {}).items()}
        best = min(entry, key=lambda k: entry[k].get("rank") or 1 << 30)
        top.append(best)
        lps.append(float(entry[ids[pos]]["logprob"]) if ids[pos] in entry else float("nan"))
    return Scored(top, lps)


async def reference(base_url: str, model: str, prompts: list[dict], tokens: int) -> list[dict]:
    """float32's sequences and scores for `prompts` (each {"messages": [...]} or {"prompt": "..."})."""
    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        for p in prompts:
            if p.get("messages"):
                head = await _tokenize(http, model=model, messages=p["messages"], add_generation_prompt=True)
            else:
                head = await _tokenize(http, model=model, prompt=p["prompt"])
            r = await http.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": head,
                    "max_tokens": tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "skip_special_tokens": False,
                },
            )
            r.raise_for_status()
            text = r.json()["choices"][0]["text"]
            tail = await _tokenize(http, model=model, prompt=text, add_special_tokens=False)
            ids = head + tail[:tokens]
            if len(ids) <= len(head):
                continue
            s = await _score(http, model, ids, len(head))
            out.append({"ids": ids, "start": len(head), "top": s.top, "logprobs": s.logprobs})
    if not out:
        raise RuntimeError("quality guard: the float32 model answered no prompt")
    return out


async def agreement(base_url: str, model: str, ref: list[dict]) -> dict:
    """A candidate server's greedy agreement with float32 and its mean |logprob difference| over `ref`."""
    same = total = 0
    diffs: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        for item in ref:
            s = await _score(http, model, item["ids"], item["start"])
            same += sum(a == b for a, b in zip(s.top, item["top"]))
            total += len(item["top"])
            diffs += [abs(a - b) for a, b in zip(s.logprobs, item["logprobs"]) if a == a and b == b]
    return {
        "agreement": same / total if total else 0.0,
        "logprob_diff": sum(diffs) / len(diffs) if diffs else float("nan"),
        "positions": total,
    }


def prompts_of(requests, k: int) -> list[dict]:
    """The first `k` distinct prompts of the workload, as the guard sends them."""
    seen, out = set(), []
    for r in requests:
        key = r.prompt
        if key in seen:
            continue
        seen.add(key)
        out.append({"messages": r.messages} if r.messages else {"messages": [{"role": "user", "content": r.prompt}]})
        if len(out) == k:
            break
    return out
