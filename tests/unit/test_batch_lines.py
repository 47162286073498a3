"""The batch file's lines (llmserve/server/batch.py): parsing, the checks of the Batches API, result lines,
and `run_lines` over a stand-in app (order kept, bounded concurrency, one bad line never stops the others)."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from llmserve.server.batch import (
    BATCH_PRIORITY,
    check_lines,
    parse_line,
    parse_lines,
    result_line,
    run_lines,
    succeeded,
)

CHAT = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}


def _text(*objs) -> str:
    return "\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs)


def test_a_good_line_is_a_request():
    line = parse_line(0, json.dumps(CHAT))
    assert (line.custom_id, line.url, line.body, line.error) == ("a", "/v1/chat/completions", {"messages": []}, None)
    assert parse_line(0, json.dumps({k: v for k, v in CHAT.items() if k != "method"})).error is None  # POST implied


def test_malformed_lines_say_what_is_wrong():
    cases = {
        "{not json": "invalid_json",
        "[1, 2]": "invalid_request",
        json.dumps({**CHAT, "custom_id": ""}): "missing_custom_id",
        json.dumps({**CHAT, "method": "GET"}): "invalid_method",
        json.dumps({**CHAT, "url": "/v1/responses"}): "invalid_url",
        json.dumps({**CHAT, "body": "hi"}): "invalid_body",
    }
    for text, code in cases.items():
        line = parse_line(2, text)
        assert line.error["code"] == code, text
        assert line.error["message"].startswith("line 3: "), line.error
    assert parse_line(0, json.dumps({**CHAT, "method": "GET"})).custom_id == "a"  # kept where there is one
    assert parse_line(0, json.dumps(CHAT), endpoint="/v1/completions").error["code"] == "mismatched_url"


def test_blank_lines_are_skipped_but_numbering_follows_the_file():
    lines = parse_lines(_text(CHAT, "", {**CHAT, "custom_id": "b"}) + "\n")
    assert [(x.index, x.custom_id) for x in lines] == [(0, "a"), (2, "b")]


def test_check_lines_finds_bad_and_repeated_lines_and_empty_files():
    assert check_lines(parse_lines(_text(CHAT, {**CHAT, "custom_id": "b"}))) == []
    errors = check_lines(parse_lines(_text(CHAT, "oops", CHAT)))
    assert [(e["code"], e["line"]) for e in errors] == [("invalid_json", 2), ("duplicate_custom_id", 3)]
    assert check_lines(parse_lines("\n\n"))[0]["code"] == "empty_file"
    assert len(check_lines(parse_lines(_text(*["x"] * 20)), limit=5)) == 5


def test_result_lines_in_openai_shape():
    ok = result_line(parse_line(0, json.dumps(CHAT)), 200, {"id": "chatcmpl-1"}, "chatcmpl-1")
    assert ok["id"].startswith("batch_req_") and ok["custom_id"] == "a" and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "chatcmpl-1", "body": {"id": "chatcmpl-1"}}
    assert succeeded(ok)
    refused = result_line(parse_line(0, json.dumps(CHAT)), 400, {"error": {}})
    assert not succeeded(refused) and refused["response"]["request_id"].startswith("batch_req_")
    bad = result_line(parse_line(0, "{"))
    assert bad["response"] is None and bad["error"]["code"] == "invalid_json" and not succeeded(bad)


def _stand_in():
    app = FastAPI()
    seen = {"running": 0, "most": 0, "bodies": []}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen["bodies"].append(body)
        seen["running"] += 1
        seen["most"] = max(seen["most"], seen["running"])
        await asyncio.sleep(0.01 * body.get("wait", 1))
        seen["running"] -= 1
        if body.get("fail"):
            return JSONResponse({"error": {"message": "no"}}, status_code=400)
        return {"id": f"chatcmpl-{body['n']}", "n": body["n"]}

    return app, seen


def _line(cid: str, **body) -> dict:
    return {"custom_id": cid, "url": "/v1/chat/completions", "body": body}


def test_run_lines_keeps_order_bounds_concurrency_and_isolates_failures():
    app, seen = _stand_in()
    objs = [_line(f"r{i}", n=i, wait=10 - i) for i in range(10)]
    objs[3] = _line("r3", n=3, fail=True)
    objs[5] = "not json"
    objs[7] = _line("r7", n=7, stream=True)
    lines = parse_lines(_text(*objs))
    done = []

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await run_lines(client, lines, 3, on_result=lambda line, _r: done.append(line.index), priority=7)

    results = asyncio.run(go())
    assert sorted(results) == list(range(10)) and sorted(done) == list(range(10))
    assert seen["most"] <= 3
    assert results[0]["response"]["body"] == {"id": "chatcmpl-0", "n": 0}
    assert results[0]["response"]["request_id"] == "chatcmpl-0"
    assert results[3]["response"]["status_code"] == 400
    assert results[5]["error"]["code"] == "invalid_json" and results[5]["response"] is None
    assert results[7]["response"]["status_code"] == 400  # no streams in a batch
    assert "stream" in results[7]["response"]["body"]["error"]["message"]
    assert all(succeeded(results[i]) for i in (0, 1, 2, 4, 6, 8, 9))
    assert {b["priority"] for b in seen["bodies"]} == {7}
    assert BATCH_PRIORITY > 0


def test_run_lines_stops_starting_lines_when_told():
    app, _ = _stand_in()
    lines = parse_lines(_text(*[_line(f"r{i}", n=i) for i in range(6)]))
    finished = []

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await run_lines(
                client, lines, 1, on_result=lambda line, r: finished.append(line.index), stop=lambda: len(finished) >= 2
            )

    results = asyncio.run(go())
    assert sorted(results) == [0, 1]


def test_a_line_refused_for_a_full_queue_is_sent_again():
    app, calls = FastAPI(), []

    @app.post("/v1/completions")
    async def completions():
        calls.append(1)
        if len(calls) < 3:
            return JSONResponse({"error": {"message": "full"}}, status_code=429, headers={"Retry-After": "0"})
        return {"id": "cmpl-1"}

    (line,) = parse_lines(json.dumps({"custom_id": "q", "url": "/v1/completions", "body": {"prompt": "x"}}))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await run_lines(client, [line], 1)

    assert succeeded(asyncio.run(go())[0]) and len(calls) == 3
