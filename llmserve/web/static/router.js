// The router page's dashboard: GET /router/backends every second (health, in-flight, the load
// the router scrapes from each backend's /metrics, and where the last requests went and why).
"use strict";

const backendCards = {};

function td(text, cls) {
  const c = document.createElement("td");
  c.textContent = text;
  if (cls) c.className = cls;
  return c;
}

async function pollRouter() {
  let d;
  try {
    const r = await api("/router/backends");
    if (!r.ok) { setConn("error " + r.status, "bad"); return; }
    d = await r.json();
  } catch (e) { setConn("offline", "bad"); return; }
  const healthy = d.backends.filter((b) => b.healthy).length;
  document.getElementById("router-summary").textContent =
    `policy ${d.policy} · ${healthy}/${d.backends.length} backends healthy · ${d.queued} queued in the router`;
  const tbody = document.querySelector("#backends tbody");
  tbody.innerHTML = "";
  for (const b of d.backends) {
    const tr = document.createElement("tr");
    const h = b.healthy ? "healthy" : ("down" + (b.ejected_reason ? ": " + b.ejected_reason : ""));
    tr.append(td(b.url), td(h, b.healthy ? "health-ok" : "health-bad"), td(String(b.outstanding)),
      td(fmt(b.running, 0)), td(fmt(b.waiting, 0)),
      td(b.kv_usage === null || b.kv_usage === undefined ? "–" : fmt(b.kv_usage * 100, 1) + " %"));
    tbody.appendChild(tr);
    let card = backendCards[b.url];
    if (!card) {
      const id = "backend-" + Object.keys(backendCards).length;
      card = backendCards[b.url] = makeCard(document.getElementById("cards"), id, b.url,
        ["In flight", "Running", "Waiting", "KV %"]);
    }
    const kv = b.kv_usage === null || b.kv_usage === undefined ? null : b.kv_usage * 100;
    card.push([b.outstanding, b.running, b.waiting, kv],
      [String(b.outstanding), fmt(b.running, 0), fmt(b.waiting, 0), kv === null ? "–" : fmt(kv, 1)]);
    card.element.classList.toggle("down", !b.healthy);
  }
  const rb = document.querySelector("#recent tbody");
  rb.innerHTML = "";
  for (const x of (d.recent || []).slice(0, 15)) {
    const tr = document.createElement("tr");
    tr.append(td(new Date(x.time * 1000).toLocaleTimeString()), td(x.backend), td(x.reason), td(x.model || "–"));
    rb.appendChild(tr);
  }
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

pollRouter();
setInterval(pollRouter, 1000);
