"""Images in, text out, through a real `llmserve serve` of a tiny random Idefics3 (SmolVLM) checkpoint written by
the test (tests/vision_files.py): the official openai client's chat `image_url` parts (a data: URL, and an http URL
from an allowed host) and Responses `input_image`, the anthropic client's base64 `image` blocks, the ollama
client's `images`; greedy answers equal transformers' generate on the same picture, from the checkpoint folder and
from the same checkpoint as a GGUF pair (`--mmproj`); /tokenize and count_tokens count the image tokens; an image
beside tools (a forced call parsed); and every bad image (undecodable, too large, too many, an unreachable or
disallowed URL, not an image at all) is a 400 that leaves the server serving. (An image to a text-only model:
tests/e2e/test_hostile.py's image_part rows, test_ollama.py's.) And a tiny Qwen2.5-VL served: its multimodal rotary
positions through the server's prompt path give transformers' answer."""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest
import torch

from llmserve.testing.launcher import ServerProcess, free_port
from tests.vision_files import pictures, qwen_processor, write_idefics3, write_qwen_vl, write_vlm_ggufs

MAX_TOKENS = 8
SIZES = {0: (40, 50), 1: (24, 64)}  # the two pictures: 2x2 tiles and 1x2 tiles (and the whole picture each)
QUESTION = "What is in the picture?"
GREEDY = {"temperature": 0, "ignore_eos": True}


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, bundled_gguf):
    d = tmp_path_factory.mktemp("vlm")
    write_idefics3(d, bundled_gguf)
    return d


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' greedy text and prompt length for [one picture, QUESTION], per picture seed."""
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(checkpoint)
    proc = T.Idefics3Processor(
        image_processor=T.Idefics3ImageProcessorPil.from_pretrained(checkpoint), tokenizer=tok, image_seq_len=4
    )
    model = T.Idefics3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    out = {}
    for seed in (0, 1):
        enc = proc(text=[text], images=[pictures(1, seed, SIZES[seed])], return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            ids = model.generate(**enc, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        n = enc["input_ids"].shape[1]
        out[seed] = (tok.decode(ids[0, n:], skip_special_tokens=True), n)
    assert out[0][0] != out[1][0]  # the answer depends on the picture
    return out


class _Images(BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}

    def do_GET(self):  # noqa: N802 - http.server's name
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    _Images.files = {"/cat.png": _png(pictures(1, 0)[0]), "/noise.png": b"not an image at all"}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(checkpoint):
    flags = ("--model", str(checkpoint), "--served-model-name", "vlm", "--dtype", "float32", "--num-threads", "1")
    flags += ("--max-num-batched-tokens", "32", "--kv-cache-memory", "0.05")  # chunked prefill through the image
    flags += ("--allowed-media-domains", "127.0.0.1", "--limit-mm-per-prompt", "image=2")
    with ServerProcess(*flags, env={"LLMSERVE_MAX_IMAGE_PIXELS": "40000", "LLMSERVE_IMAGE_FETCH_TIMEOUT": "3"}) as srv:
        yield srv.wait_ready()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(client, url: str, n: int = 1, **extra):
    parts = [{"type": "image_url", "image_url": {"url": url}}] * n + [{"type": "text", "text": QUESTION}]
    return client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": parts}], max_tokens=MAX_TOKENS, extra_body=GREEDY, **extra
    )


def test_openai_chat_image_url_equals_transformers(client, reference):
    for seed in (0, 1):
        r = _chat(client, _data_url(pictures(1, seed, size=SIZES[seed])[0]))
        assert r.choices[0].message.content == reference[seed][0]
        assert r.usage.prompt_tokens == reference[seed][1]
    # WebP, GIF and JPEG decode too (GIF's palette and JPEG's compression change the pixels: an answer is enough)
    for fmt in ("WEBP", "GIF", "JPEG"):
        assert _chat(client, _data_url(pictures(1, 0)[0], fmt)).choices[0].message.content


def test_http_url_from_an_allowed_host(client, reference, image_host):
    r = _chat(client, image_host + "/cat.png")
    assert r.choices[0].message.content == reference[0][0]


def test_streamed_chat_with_an_image(client, reference):
    stream = _chat(client, _data_url(pictures(1, 1, size=SIZES[1])[0]), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference[1][0]


def test_responses_input_image(client, reference):
    r = client.responses.create(
        model="vlm",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": _data_url(pictures(1, 0)[0])},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        max_output_tokens=MAX_TOKENS,
        extra_body=GREEDY,
    )
    assert r.output_text == reference[0][0]


def test_anthropic_base64_image_block(server, reference):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    data = base64.b64encode(_png(pictures(1, 1, size=SIZES[1])[0])).decode()
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": QUESTION},
    ]
    m = client.messages.create(
        model="vlm", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": content}], extra_body=GREEDY
    )
    assert m.content[0].text == reference[1][0]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == reference[1][1]
    count = client.messages.count_tokens(model="vlm", messages=[{"role": "user", "content": content}])
    assert count.input_tokens == reference[1][1]


def test_tokenize_counts_image_tokens(server, reference):
    parts = [
        {"type": "image_url", "image_url": {"url": _data_url(pictures(1, 0)[0])}},
        {"type": "text", "text": QUESTION},
    ]
    r = httpx.post(server.url + "/tokenize", json={"model": "vlm", "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == reference[0][1]
    plain = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": QUESTION}]}).json()
    assert plain["count"] < reference[0][1] - 20  # the picture's 20 image tokens and their markers


PICTURE_TOOL = {
    "type": "function",
    "function": {
        "name": "describe_picture",
        "description": "Say the main colour of the picture",
        "parameters": {
            "type": "object",
            "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
            "required": ["colour"],
        },
    },
}


def test_image_with_tools_and_a_forced_call(server, client, reference):
    """An image beside tools: accepted, the image's tokens counted in usage (the same number as without tools), and
    a forced tool_choice answered with a parsed call; the call and its result go back with the image (a second turn)."""
    forced = {"type": "function", "function": {"name": "describe_picture"}}
    question = {"type": "text", "text": QUESTION}

    def ask(messages, **extra):
        return client.chat.completions.create(
            model="vlm", messages=messages, tools=[PICTURE_TOOL], max_tokens=60, temperature=0, **extra
        )

    turn = [{"role": "user", "content": [_image(_data_url(pictures(1, 0, size=SIZES[0])[0])), question]}]
    r = ask(turn, tool_choice=forced)
    assert r.choices[0].finish_reason == "tool_calls", r
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "describe_picture" and call.id
    assert json.loads(call.function.arguments)["colour"] in ("red", "green", "blue")
    without = ask([{"role": "user", "content": [question]}], tool_choice=forced)
    plain = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": [question]}]}).json()
    image_tokens = reference[0][1] - plain["count"]  # the picture's run, as transformers' processor writes it
    assert image_tokens > 20 and r.usage.prompt_tokens - without.usage.prompt_tokens == image_tokens
    history = turn + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": True})},
    ]
    again = ask(history, extra_body={"ignore_eos": True})  # tool_choice auto: an answer or a call, parsed
    assert again.choices[0].message.content or again.choices[0].message.tool_calls
    assert again.usage.prompt_tokens > r.usage.prompt_tokens


def test_ollama_client_sends_images(server, client, reference):
    """The official ollama client's `images` (bytes, sent as bare base64) on /api/chat and /api/generate: Ollama
    puts them before the text, so the prompt is transformers' [picture, QUESTION] and the greedy answer the openai
    client's for the same picture; /api/show says "vision"; a bad image is a 400 in Ollama's shape naming it."""
    import ollama

    picture = pictures(1, 0, size=SIZES[0])[0]
    oc = ollama.Client(host=server.url, timeout=120)
    opts = {"temperature": 0, "num_predict": MAX_TOKENS, "repeat_penalty": 1.0}  # (Ollama's default: 1.1)
    r = oc.chat(model="vlm", messages=[{"role": "user", "content": QUESTION, "images": [_png(picture)]}], options=opts)
    parts = [_image(_data_url(picture)), {"type": "text", "text": QUESTION}]
    same = client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": parts}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert r.message.content == same.choices[0].message.content and r.prompt_eval_count == reference[0][1]
    g = oc.generate(model="vlm", prompt=QUESTION, images=[_png(picture)], options=opts)
    assert g.response == r.message.content and g.prompt_eval_count == reference[0][1]
    assert "vision" in oc.show("vlm").capabilities
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="vlm", messages=[{"role": "user", "content": QUESTION, "images": [b"not an image"]}])
    assert e.value.status_code == 400 and e.value.error.startswith("messages[0].images[0]: "), e.value.error
    for bad in ("%%%", _data_url(picture), base64.b64encode(b"not an image").decode()):  # (no data: prefix)
        body = {"model": "vlm", "prompt": QUESTION, "images": [bad], "stream": False}
        r = httpx.post(server.url + "/api/generate", json=body, timeout=60)
        assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
        assert r.json()["error"].startswith("images[0]: "), r.text
    r = httpx.post(server.url + "/api/generate", json={**body, "raw": True}, timeout=60)
    assert r.status_code == 400 and "raw" in r.json()["error"]
    assert oc.chat(model="vlm", messages=[{"role": "user", "content": QUESTION}], options=opts).message.content


def _status(server, parts) -> tuple[int, dict]:
    body = {"model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    return r.status_code, r.json()


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_bad_images_are_400s_and_the_server_keeps_serving(server, client, reference, image_host):
    closed = f"http://127.0.0.1:{free_port()}/x.png"
    bad = {
        "undecodable": [_image("data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode())],
        "not_base64": [_image("data:image/png;base64,%%%")],
        "too_large": [_image(_data_url(pictures(1, 0, size=(250, 250))[0]))],  # over LLMSERVE_MAX_IMAGE_PIXELS
        "too_many": [_image(_data_url(pictures(1, 0)[0]))] * 3,  # over --limit-mm-per-prompt image=2
        "unreachable": [_image(closed)],
        "not_found": [_image(image_host + "/missing.png")],
        "not_an_image": [_image(image_host + "/noise.png")],
        "disallowed_host": [_image("http://example.com/cat.png")],
        "file_scheme": [_image("file:///etc/passwd")],
        "bmp": [_image(_data_url(pictures(1, 0)[0], "BMP"))],
        "placeholder_as_text": [{"type": "text", "text": "<image>"}],
    }
    for name, parts in bad.items():
        status, body = _status(server, parts)
        assert status == 400, (name, body)
        assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error", (name, body)
    assert _status(server, [_image(_data_url(pictures(1, 0)[0]))] * 2)[0] == 200  # two: within the limit
    assert _chat(client, _data_url(pictures(1, 0)[0])).choices[0].message.content == reference[0][0]


def test_gguf_pair_with_mmproj_serves_the_same_answers(checkpoint, reference):
    """`llmserve serve --model text.gguf --mmproj mmproj.gguf`: the same checkpoint written as llama.cpp's converter
    writes a vision-language model (tests/vision_files.py) answers transformers' greedy text with the same count."""
    (checkpoint / "gguf").mkdir()  # (no tokenizer files beside the GGUF files, as a download has none)
    text, mmproj = write_vlm_ggufs(
        checkpoint, str(checkpoint / "gguf" / "text.gguf"), str(checkpoint / "gguf" / "mmproj.gguf")
    )
    flags = ("--model", text, "--mmproj", mmproj, "--served-model-name", "vlm", "--num-threads", "1")
    with ServerProcess(*flags, "--kv-cache-memory", "0.05") as srv:
        srv.wait_ready()
        gguf = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for seed in (0, 1):
            r = _chat(gguf, _data_url(pictures(1, seed, size=SIZES[seed])[0]))
            assert (r.choices[0].message.content, r.usage.prompt_tokens) == reference[seed]


def test_web_page_attaches_an_image(server, reference, tmp_path):
    """The page's "Attach image" (docs/web.md) in a real browser: the picture goes as an image_url part, the
    greedy answer is transformers' for it, and the user's bubble shows the picture."""
    from playwright.sync_api import sync_playwright

    from tests.e2e.test_web_page import ARGS, CHROMIUM, _need_browser

    _need_browser()
    path = tmp_path / "picture.png"
    path.write_bytes(_png(pictures(1, 0, size=SIZES[0])[0]))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('conn').textContent === 'ready'", timeout=30_000)
            page.get_by_text("Settings").click()
            page.get_by_label("Temperature", exact=True).fill("0")
            page.get_by_label("Max tokens", exact=True).fill(str(MAX_TOKENS))
            page.get_by_label("Ignore end of text", exact=True).check()
            page.set_input_files("#attach", str(path))
            page.wait_for_function("document.getElementById('attached').textContent === '1 image attached'")
            page.get_by_label("Message", exact=True).fill(QUESTION)
            page.get_by_label("Message", exact=True).press("Enter")
            page.locator(".msg.assistant[data-done=finished]").wait_for(timeout=60_000)
            assert page.locator(".msg.assistant .text").last.text_content() == reference[0][0]
            assert page.locator(".msg.user img.thumb").count() == 1
            assert page.locator("#attached").text_content() == ""  # sent: nothing attached for the next one
            assert not errors, errors
        finally:
            browser.close()


def test_qwen25vl_served_answers_as_transformers(tmp_path, bundled_gguf):
    """A Qwen2.5-VL checkpoint behind the server (its image run and 3-D positions made from the chat's image part):
    the openai client's greedy answer for a picture is transformers' generate's, and another picture's differs."""
    import transformers as T

    write_qwen_vl(tmp_path, bundled_gguf)
    tok = T.AutoTokenizer.from_pretrained(tmp_path)
    proc = qwen_processor(T.Qwen2VLImageProcessorPil.from_pretrained(tmp_path), tok)
    model = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    flags = ("--model", str(tmp_path), "--served-model-name", "vlm", "--dtype", "float32", "--num-threads", "1")
    with ServerProcess(*flags, "--max-num-batched-tokens", "16", "--kv-cache-memory", "0.05") as srv:
        client = openai.OpenAI(base_url=srv.wait_ready().url + "/v1", api_key="x", max_retries=0, timeout=120)
        answers = []
        for seed in (0, 1):
            picture = pictures(1, seed, SIZES[seed])
            enc = proc(text=[text], images=[picture])
            with torch.inference_mode():
                ids = model.generate(**enc, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
            n = enc["input_ids"].shape[1]
            r = _chat(client, _data_url(picture[0]))
            assert r.choices[0].message.content == tok.decode(ids[0, n:], skip_special_tokens=True)
            assert r.usage.prompt_tokens == n
            answers.append(r.choices[0].message.content)
        assert answers[0] != answers[1]
