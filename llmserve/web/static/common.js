// Shared by the server page (app.js) and the router page (router.js): the API key, fetch with
// the key, number formatting, and a tiny canvas line chart. No dependencies, no build step.
"use strict";

const KEY_STORE = "llmserve-api-key";

const Key = {
  get() { return sessionStorage.getItem(KEY_STORE) || ""; },
  set(k) { if (k) sessionStorage.setItem(KEY_STORE, k); else sessionStorage.removeItem(KEY_STORE); },
  headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = Key.get();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  },
};

// Ask for the key in the <dialog>; resolves true when one was entered.
function askKey() {
  const dlg = document.getElementById("key-dialog");
  const input = document.getElementById("api-key");
  if (!dlg) return Promise.resolve(false);
  input.value = Key.get();
  return new Promise((resolve) => {
    const form = document.getElementById("key-form");
    const cancel = document.getElementById("key-cancel");
    const done = (ok) => {
      form.removeEventListener("submit", onSubmit);
      cancel.removeEventListener("click", onCancel);
      dlg.removeEventListener("cancel", onCancel);
      if (dlg.open) dlg.close();
      resolve(ok);
    };
    const onSubmit = (e) => { e.preventDefault(); Key.set(input.value.trim()); done(!!input.value.trim()); };
    const onCancel = (e) => { e.preventDefault(); done(false); };
    form.addEventListener("submit", onSubmit);
    cancel.addEventListener("click", onCancel);
    dlg.addEventListener("cancel", onCancel);
    dlg.showModal();
    input.focus();
  });
}

async function api(path, opts) {
  opts = Object.assign({}, opts || {});
  opts.headers = Key.headers(opts.headers);
  return fetch(path, opts);
}

function fmt(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (digits === undefined) digits = Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2;
  return v.toFixed(digits);
}
function fmtMs(seconds) { return seconds === null || seconds === undefined ? "–" : fmt(seconds * 1000, 0) + " ms"; }
function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return fmt(b, b >= 100 ? 0 : 1) + " " + u[i];
}

// 1, 2, 2.5, 5 x 10^k at or above v: round axis tops
function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

const COLORS = ["#2f6fdb", "#d9480f", "#2b8a3e", "#862e9c", "#e8590c", "#0b7285"];

// A line chart on a <canvas>: `series` is [{label, values: [number|null], color}], oldest first.
class LineChart {
  constructor(canvas, opts) {
    this.canvas = canvas;
    this.opts = Object.assign({ points: 60, min: 0, max: null, unit: "" }, opts || {});
  }
  draw(series) {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || 240, h = c.clientHeight || 70;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    let max = this.opts.max;
    if (max === null) {
      max = 0;
      for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
      max = niceCeil(max > 0 ? max * 1.1 : 1);
    }
    const min = this.opts.min, n = this.opts.points, pad = 2;
    g.strokeStyle = getComputedStyle(c).getPropertyValue("--grid") || "#ddd";
    g.lineWidth = 1;
    g.beginPath(); g.moveTo(0, h - pad + 0.5); g.lineTo(w, h - pad + 0.5); g.stroke();
    g.fillStyle = getComputedStyle(c).getPropertyValue("--muted") || "#666";
    g.font = "10px system-ui, sans-serif";
    g.fillText(fmt(max) + this.opts.unit, 2, 10);
    series.forEach((s, i) => {
      g.strokeStyle = s.color || COLORS[i % COLORS.length];
      g.lineWidth = 1.6;
      g.beginPath();
      let started = false;
      const vals = s.values.slice(-n), off = n - vals.length;
      vals.forEach((v, j) => {
        if (v === null || v === undefined) { started = false; return; }
        const x = ((off + j) / (n - 1)) * w;
        const y = h - pad - ((Math.min(v, max) - min) / (max - min || 1)) * (h - 14);
        if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; }
      });
      g.stroke();
    });
  }
}

// A dashboard card: title, big value(s), a small legend and a chart. Returns {set, chart}.
function makeCard(container, id, title, seriesLabels, opts) {
  const card = document.createElement("figure");
  card.className = "card";
  card.id = "card-" + id;
  const legend = seriesLabels.map((l, i) =>
    `<span class="legend-item"><i style="background:${COLORS[i % COLORS.length]}"></i>${l}: ` +
    `<b id="stat-${id}${seriesLabels.length > 1 ? "-" + l.toLowerCase().replace(/[^a-z0-9]+/g, "") : ""}">–</b></span>`).join(" ");
  card.innerHTML = `<figcaption>${title}</figcaption><div class="legend">${legend}</div>` +
    `<canvas role="img" aria-label="${title} chart"></canvas>`;
  container.appendChild(card);
  const chart = new LineChart(card.querySelector("canvas"), opts);
  const history = seriesLabels.map(() => []);
  return {
    element: card,
    push(values, texts) {
      values.forEach((v, i) => { history[i].push(v); if (history[i].length > 120) history[i].shift(); });
      seriesLabels.forEach((l, i) => {
        const el = card.querySelector(`#stat-${id}${seriesLabels.length > 1 ? "-" + l.toLowerCase().replace(/[^a-z0-9]+/g, "") : ""}`);
        el.textContent = texts ? texts[i] : fmt(values[i]);
      });
      chart.canvas.setAttribute("aria-label", title + ": " +
        seriesLabels.map((l, i) => l + " " + (texts ? texts[i] : fmt(values[i]))).join(", "));
      chart.draw(history.map((values, i) => ({ label: seriesLabels[i], values })));
    },
  };
}
