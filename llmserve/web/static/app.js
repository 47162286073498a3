// The server page: chat with the served model (streamed over SSE from /v1/chat/completions)
// and a dashboard polled every second from GET /stats.
"use strict";

const $ = (id) => document.getElementById(id);
// images: the data: URLs attached for the next message (a vision-language model's image_url parts)
const state = { messages: [], controller: null, busy: false, modelsTimer: null, images: [] };

// -- models and key ----------------------------------------------------------------------------
async function loadModels() {
  let r;
  try { r = await api("/v1/models"); } catch (e) { setConn("offline", "bad"); return; }
  if (r.status === 401) {
    setConn("API key needed", "warn");
    if (await askKey()) return loadModels();
    return;
  }
  if (r.status === 503) { setConn("model loading…", "warn"); setTimeout(loadModels, 2000); return; }
  if (!r.ok) { setConn("error " + r.status, "bad"); return; }
  const data = await r.json();
  const sel = $("model");
  const keep = sel.value;
  sel.innerHTML = "";
  for (const m of data.data) {
    const o = document.createElement("option");
    o.value = o.textContent = m.id;
    if (m.parent) o.textContent = `${m.id} (LoRA adapter of ${m.parent})`;
    // --models-dir: every model of the folder, loaded or not (a request loads it); a failed one can't be chosen
    const status = m.status && m.status.value;
    if (status && status !== "loaded") o.textContent = `${m.id} (${status})`;
    if (status === "failed") { o.disabled = true; o.title = m.status.error || ""; }
    sel.appendChild(o);
  }
  if (keep && [...sel.options].some((o) => o.value === keep)) sel.value = keep;
  setConn("ready", "ok");
  clearTimeout(state.modelsTimer);  // several models: their states change (loads, idle unloads)
  if (data.data.length > 1) state.modelsTimer = setTimeout(loadModels, 5000);
}

function setConn(text, kind) {
  const el = $("conn");
  el.textContent = text;
  el.className = "pill " + (kind || "");
}

// -- chat --------------------------------------------------------------------------------------
function addBubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : role === "assistant" ? "Model" : "Error";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text || "";
  div.append(who, body);
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

// A thinking model's reasoning (reasoning_content), folded above the answer: open it to read it.
function showReasoning(bubble, text, streaming) {
  let box = bubble.querySelector("details.reasoning");
  if (!box) {
    box = document.createElement("details");
    box.className = "reasoning";
    box.append(document.createElement("summary"), document.createElement("div"));
    box.lastChild.className = "reasoning-text";
    bubble.insertBefore(box, bubble.querySelector(".text"));
  }
  box.firstChild.textContent = streaming ? "Thinking…" : `Reasoning (${text.length} characters)`;
  box.lastChild.textContent = text;
}

function setBusy(busy) {
  state.busy = busy;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("chat-form").setAttribute("aria-busy", busy ? "true" : "false");
}

function num(id, parse) {
  const v = parse($(id).value);
  return Number.isFinite(v) ? v : undefined;
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const fr = new FileReader();
    fr.onload = () => resolve(fr.result);
    fr.onerror = () => reject(fr.error);
    fr.readAsDataURL(file);
  });
}

async function attach(files) {
  for (const f of files) state.images.push(await readImage(f));
  showAttached();
}

function showAttached() {
  const n = state.images.length;
  $("attached").textContent = n ? `${n} image${n > 1 ? "s" : ""} attached` : "";
}

async function send(text) {
  if (state.busy || !text.trim()) return;
  const images = state.images;
  state.images = [];
  showAttached();
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  state.messages.push({ role: "user", content: images.length ? [...parts, { type: "text", text }] : text });
  const mine = addBubble("user", text);
  for (const url of images) {
    const img = document.createElement("img");
    img.src = url;
    img.alt = "attached image";
    img.className = "thumb";
    mine.appendChild(img);
  }
  const bubble = addBubble("assistant", "");
  bubble.classList.add("streaming");
  const body = bubble.querySelector(".text");
  const stats = document.createElement("div");
  stats.className = "answer-stats";
  bubble.appendChild(stats);

  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.messages);
  const req = {
    model: $("model").value || undefined, messages, stream: true,
    stream_options: { include_usage: true },
    temperature: num("temperature", parseFloat), top_p: num("top_p", parseFloat),
    max_tokens: num("max_tokens", (v) => parseInt(v, 10)),
  };
  if ($("ignore_eos").checked) req.ignore_eos = true;

  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null, chunks = 0, usageTokens = null, text_ = "", reasoning_ = "", finish = null, stopped = false;
  const showStats = () => {
    const now = performance.now();
    const tokens = usageTokens !== null ? usageTokens : chunks;
    const ttft = tFirst === null ? null : (tFirst - t0) / 1000;
    const gen = tFirst === null ? 0 : (now - tFirst) / 1000;
    const tps = tokens > 1 && gen > 0 ? (tokens - 1) / gen : null;
    stats.innerHTML = "";
    for (const [k, v] of [["TTFT", fmtMs(ttft)], ["tokens/s", fmt(tps, 1)], ["tokens", String(tokens)]]) {
      const s = document.createElement("span");
      s.className = "fig fig-" + k.replace("/", "");
      s.textContent = `${k} ${v}`;
      stats.appendChild(s);
    }
    if (stopped) stats.append(" · stopped");
    else if (finish) stats.append(" · finish: " + finish);
  };
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(req), signal: controller.signal,
    });
    if (r.status === 401) {
      bubble.remove();
      state.messages.pop();
      $("log").lastChild && $("log").lastChild.remove();
      setBusy(false);
      if (await askKey()) { loadModels(); return send(text); }
      addBubble("error", "an API key is needed");
      return;
    }
    if (!r.ok) {
      let msg = "HTTP " + r.status;
      try { msg = (await r.json()).error.message; } catch (e) { /* keep the status */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, i).trim();
        buf = buf.slice(i + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const ev = JSON.parse(data);
        if (ev.error) throw new Error(ev.error.message || "stream error");
        if (ev.usage) usageTokens = ev.usage.completion_tokens;
        for (const ch of ev.choices || []) {
          const d = ch.delta && ch.delta.content;
          const r = ch.delta && ch.delta.reasoning_content;   // --reasoning-parser: shown folded
          if (d || r) {
            if (tFirst === null) tFirst = performance.now();
            chunks++;
          }
          if (r) {
            reasoning_ += r;
            showReasoning(bubble, reasoning_, true);
          }
          if (d) {
            text_ += d;
            body.textContent = text_;
          }
          if (ch.finish_reason) finish = ch.finish_reason;
        }
        showStats();
        $("log").scrollTop = $("log").scrollHeight;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else {
      const err = addBubble("error", String(e.message || e));
      err.setAttribute("role", "alert");
      if (images.length && !text_) state.messages.pop();   // a refused image is not sent again
    }
  } finally {
    bubble.classList.remove("streaming");
    bubble.dataset.done = stopped ? "stopped" : "finished";
    if (reasoning_) showReasoning(bubble, reasoning_, false);
    showStats();
    if (text_) state.messages.push({ role: "assistant", content: text_ });
    state.controller = null;
    setBusy(false);
    $("prompt").focus();
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

// -- dashboard ---------------------------------------------------------------------------------
const cards = {};
let prev = null;
const hist = [];   // recent snapshots for windowed rates

function buildCards() {
  const c = $("cards");
  cards.tps = makeCard(c, "tokens-per-s", "Output tokens/s", ["tokens/s"]);
  cards.req = makeCard(c, "requests", "Requests", ["Running", "Waiting"]);
  cards.kv = makeCard(c, "kv", "KV cache usage", ["used %"], { max: 100, unit: "%" });
  cards.hit = makeCard(c, "prefix-hit", "Prefix-cache hit rate (10 s)", ["hit %"], { max: 100, unit: "%" });
  cards.ttft = makeCard(c, "ttft", "TTFT, last minute", ["p50", "p90", "p99"], { unit: "s" });
  cards.itl = makeCard(c, "itl", "Inter-token latency, last minute", ["p50", "p90", "p99"], { unit: "s" });
  cards.pre = makeCard(c, "preemptions", "Preemptions", ["total", "per s"]);
  cards.cpu = makeCard(c, "cpu", "Process CPU", ["cpu %"], { unit: "%" });
  cards.mem = makeCard(c, "memory", "Process memory (RSS)", ["RSS"], { unit: " MiB" });
}

async function poll() {
  let s;
  try {
    const r = await api("/stats");
    if (r.status === 401) { setConn("API key needed for /stats", "warn"); return; }
    s = await r.json();
  } catch (e) {
    setConn("offline", "bad");
    return;
  }
  if (s.num_requests_running === undefined) { $("updated").textContent = "(model loading)"; return; }
  hist.push(s);
  while (hist.length > 11) hist.shift();
  const dt = prev ? s.time - prev.time : 0;
  const rate = (k) => (prev && dt > 0 && s[k] !== null && prev[k] !== null ? (s[k] - prev[k]) / dt : null);
  const tps = rate("generation_tokens");
  cards.tps.push([tps], [fmt(tps, 1)]);
  cards.req.push([s.num_requests_running, s.num_requests_waiting],
    [String(s.num_requests_running), String(s.num_requests_waiting)]);
  const kv = s.kv_cache_usage * 100;
  cards.kv.push([kv], [fmt(kv, 1) + " %"]);
  const old = hist[0];
  const dq = s.prefix_cache_queries - old.prefix_cache_queries;
  let hit = null;
  if (dq > 0) hit = (100 * (s.prefix_cache_hits - old.prefix_cache_hits)) / dq;
  else if (s.prefix_cache_queries > 0) hit = (100 * s.prefix_cache_hits) / s.prefix_cache_queries;
  cards.hit.push([hit], [hit === null ? "–" : fmt(hit, 1) + " %"]);
  cards.ttft.push([s.ttft.p50, s.ttft.p90, s.ttft.p99], [fmtMs(s.ttft.p50), fmtMs(s.ttft.p90), fmtMs(s.ttft.p99)]);
  cards.itl.push([s.itl.p50, s.itl.p90, s.itl.p99], [fmtMs(s.itl.p50), fmtMs(s.itl.p90), fmtMs(s.itl.p99)]);
  const pre = rate("num_preemptions");
  cards.pre.push([s.num_preemptions, pre], [String(s.num_preemptions), fmt(pre, 1)]);
  const cpu = rate("process_cpu_seconds");
  cards.cpu.push([cpu === null ? null : cpu * 100], [cpu === null ? "–" : fmt(cpu * 100, 0) + " %"]);
  const mib = s.process_resident_memory_bytes === null ? null : s.process_resident_memory_bytes / 1048576;
  cards.mem.push([mib], [fmtBytes(s.process_resident_memory_bytes)]);
  if (s.kv_remote) pushStore(s.kv_remote, old.kv_remote || s.kv_remote);
  $("updated").textContent = "updated " + new Date(s.time * 1000).toLocaleTimeString();
  prev = s;
}

// --kv-cache-url: the shared store's card, made on the first /stats that has it
const BREAKER = ["closed", "open", "half-open"];
function pushStore(k, old) {
  if (!cards.store) {
    cards.store = makeCard($("cards"), "kv-store", "Shared KV store hit rate (10 s)",
      ["hit %", "read MiB/s"], { unit: "" });
    const p = document.createElement("p");
    p.id = "kv-store-state";
    p.setAttribute("aria-live", "polite");
    cards.store.element.appendChild(p);
  }
  const dq = k.queries - old.queries;
  const hit = dq > 0 ? (100 * (k.hits - old.hits)) / dq : (k.queries > 0 ? (100 * k.hits) / k.queries : null);
  const dt = hist.length > 1 ? hist[hist.length - 1].time - hist[0].time : 0;
  const mibs = dt > 0 ? (k.bytes_read - old.bytes_read) / dt / 1048576 : null;
  cards.store.push([hit, mibs], [hit === null ? "–" : fmt(hit, 1) + " %", mibs === null ? "–" : fmt(mibs, 1)]);
  $("kv-store-state").textContent = `breaker ${BREAKER[k.breaker_state] || k.breaker_state} · ` +
    `hits ${k.hits} · misses ${k.misses} tokens · read ${fmtBytes(k.bytes_read)} · ` +
    `written ${fmtBytes(k.bytes_written)} · errors ${k.errors} · bad entries ${k.corrupt_blocks}`;
  $("kv-store-state").className = k.breaker_state ? "warn" : "";
}

// -- wiring ------------------------------------------------------------------------------------
function init() {
  const routerPage = document.body.dataset.mode === "router";   // router.js draws that dashboard
  if (!routerPage) buildCards();
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.busy && !$("key-dialog").open) stop();
  });
  $("stop").addEventListener("click", stop);
  $("attach").addEventListener("change", async (e) => { await attach([...e.target.files]); e.target.value = ""; });
  $("clear").addEventListener("click", () => {
    state.messages = []; state.images = []; showAttached(); $("log").innerHTML = "";
  });
  $("key-button").addEventListener("click", async () => { if (await askKey()) loadModels(); });
  loadModels();
  if (!routerPage) { poll(); setInterval(poll, 1000); }
}

init();
