// quill console: polls /console/state about 1.3 times a second and draws it; the playground streams a
// completion. Plain JavaScript, charts drawn as SVG strings from numbers only (text from the
// server goes in through textContent). The page keeps nothing a reload would lose but the
// playground's form, which it saves in localStorage.
"use strict";

const POLL_MS = 750; // from one request's start to the next: about 1.3 redraws a second
const STEPS_DRAWN = 120;
const SERIES_S = 600;
const FORM_KEY = "quill-console-playground";
const $ = (id) => document.getElementById(id);

let paused = false;
let modelName = null;
let updates = 0;
let player = null; // the playground's AbortController while a reply streams

// -- numbers as text ------------------------------------------------------------------------
function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1e-3) return (s * 1e6).toPrecision(3) + " µs";
  if (s < 1) return (s * 1e3).toPrecision(3) + " ms";
  return s.toPrecision(3) + " s";
}
function percent(x) {
  return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
}
function count(n) {
  return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en");
}
function si(x, unit) {
  if (x === null || x === undefined) return "–";
  const prefixes = ["", "k", "M", "G", "T", "P"];
  let i = 0;
  while (Math.abs(x) >= 1000 && i < prefixes.length - 1) { x /= 1000; i++; }
  return x.toPrecision(3) + " " + prefixes[i] + unit;
}
function usd(x) {
  if (x === null || x === undefined) return "–";
  return x >= 0.01 ? "$" + x.toFixed(2) : "$" + x.toPrecision(2);
}
function rate(x) {
  return x === null || x === undefined ? "–" : x.toFixed(1);
}
// Redraw only what changed: an idle server's page then costs the browser next to nothing.
function changed(element, key) {
  if (element.dataset.key === key) return false;
  element.dataset.key = key;
  return true;
}
function setText(id, text) {
  const element = $(id);
  if (element.textContent !== text) element.textContent = text;
}
// A time `at` seconds from now (negative: past) on this browser's clock, to the second.
function clock(at) {
  return new Date(Date.now() + at * 1000).toLocaleTimeString("en-GB");
}
function shortId(id) {
  return id.length > 20 ? id.slice(0, 19) + "…" : id;
}
function median(values) {
  if (!values.length) return null;
  const v = [...values].sort((a, b) => a - b);
  const mid = v.length >> 1;
  return v.length % 2 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

// -- charts -----------------------------------------------------------------------------------
const W = 960, H = 200, LEFT = 56, BOTTOM = 22, TOP = 8;
function svg(width, height, label, body) {
  return `<svg viewBox="0 0 ${width} ${height}" role="img" aria-label="${label}">${body}</svg>`;
}
function linearAxis(max) {
  const top = max > 0 ? max : 1;
  return { y: (v) => TOP + (H - BOTTOM - TOP) * (1 - v / top), ticks: [0, top / 2, top] };
}
function logAxis(values) {
  const positive = values.filter((v) => v > 0);
  let lo = Math.floor(Math.log10(positive.length ? Math.min(...positive) : 1e-3));
  let hi = Math.ceil(Math.log10(positive.length ? Math.max(...positive) : 1));
  if (hi <= lo) hi = lo + 1;
  const y = (v) => TOP + (H - BOTTOM - TOP) * (1 - (Math.log10(Math.max(v, 10 ** lo)) - lo) / (hi - lo));
  const ticks = [];
  for (let e = lo; e <= hi; e++) ticks.push(10 ** e);
  return { y, ticks };
}
function yAxis(axis, format) {
  return axis.ticks.map((t) => {
    const y = axis.y(t).toFixed(1);
    return `<line class="grid" x1="${LEFT}" x2="${W}" y1="${y}" y2="${y}"/>` +
      `<text x="${LEFT - 4}" y="${y}" text-anchor="end" dominant-baseline="middle">${format(t)}</text>`;
  }).join("") + `<line class="axis" x1="${LEFT}" x2="${LEFT}" y1="${TOP}" y2="${H - BOTTOM}"/>` +
    `<line class="axis" x1="${LEFT}" x2="${W}" y1="${H - BOTTOM}" y2="${H - BOTTOM}"/>`;
}
function polyline(cls, points) {
  const runs = [];
  let run = [];
  for (const p of points) {
    if (p === null) { if (run.length) runs.push(run); run = []; } else run.push(p);
  }
  if (run.length) runs.push(run);
  return runs.map((r) => r.length === 1
    ? `<circle class="${cls}" cx="${r[0][0].toFixed(1)}" cy="${r[0][1].toFixed(1)}" r="2"/>`
    : `<polyline class="${cls}" points="${r.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join(" ")}"/>`).join("");
}
function swatch(kind) {
  const shapes = {
    bar: '<rect class="bar" width="14" height="10"/>',
    hatched: '<rect class="bar-hatched" width="14" height="10"/>',
    light: '<rect class="bar-light" width="14" height="10"/>',
    price: '<line class="price" x1="0" x2="18" y1="5" y2="5"/>',
    arith: '<line class="floor-arith" x1="0" x2="18" y1="5" y2="5"/>',
    move: '<line class="floor-move" x1="0" x2="18" y1="5" y2="5"/>',
  };
  return `<svg width="18" height="10" aria-hidden="true">${shapes[kind]}</svg>`;
}
function legend(items) {
  return '<p class="legend">' + items.map(([kind, text]) => `<span>${swatch(kind)} ${text}</span>`).join("") + "</p>";
}

function histogram(container, dist) {
  // Drawn once, then its bars and counts moved in place: rebuilding the SVG at every update
  // was most of what the page cost the browser.
  const n = dist.histogram.length;
  const max = Math.max(1, ...dist.histogram);
  const w = 560, h = 150, slot = (w - 10) / n;
  if (container.querySelectorAll("rect[data-count]").length !== n) {
    const edge = (e) => (e < 1 ? `${Math.round(e * 1000)}ms` : `${e}s`);
    const labels = dist.buckets.map((e) => "≤" + edge(e)).concat([">" + edge(dist.buckets[n - 2])]);
    let body = "";
    labels.forEach((label, i) => {
      const x = 5 + i * slot;
      body += `<rect class="bar" data-count="0" data-label="${label}" x="${x.toFixed(1)}" ` +
        `width="${(slot - 2).toFixed(1)}"><title></title></rect>` +
        `<text data-count-of="${i}" x="${(x + slot / 2).toFixed(1)}" text-anchor="middle"></text>`;
      if (i % 2 === 0) body += `<text x="${(x + slot / 2).toFixed(1)}" y="${h - 6}" text-anchor="middle">${label}</text>`;
    });
    body += `<line class="axis" x1="0" x2="${w}" y1="${h - 22}" y2="${h - 22}"/>`;
    container.innerHTML = svg(w, h, "", body);
  }
  const bars = container.querySelectorAll("rect[data-count]");
  const counts = container.querySelectorAll("text[data-count-of]");
  dist.histogram.forEach((c, i) => {
    const bh = (h - 34) * c / max;
    const bar = bars[i];
    bar.dataset.count = String(c);
    bar.setAttribute("y", (h - 22 - bh).toFixed(1));
    bar.setAttribute("height", bh.toFixed(1));
    bar.firstChild.textContent = `${bar.dataset.label}: ${c}`;
    counts[i].setAttribute("y", (h - 25 - bh).toFixed(1));
    counts[i].textContent = c ? String(c) : "";
  });
  container.firstChild.setAttribute("aria-label",
    `histogram of ${dist.count} samples; p50 ${seconds(dist.p50)}, p99 ${seconds(dist.p99)}`);
}

function stepCharts(steps) {
  const newest = steps[steps.length - 1];
  if (!changed($("step-tokens"), newest ? String(newest.step) : "")) return;
  const shown = steps.slice(-STEPS_DRAWN);
  const slot = (W - LEFT) / STEPS_DRAWN;
  const x0 = (i) => LEFT + (STEPS_DRAWN - shown.length + i) * slot;
  const tokens = linearAxis(Math.max(1, ...shown.map((s) => s.decode_tokens + s.prefill_tokens)));
  let body = yAxis(tokens, (t) => Math.round(t));
  shown.forEach((s, i) => {
    const x = x0(i).toFixed(1), w = Math.max(slot - 1, 0.5).toFixed(1);
    const yd = tokens.y(s.decode_tokens), yt = tokens.y(s.decode_tokens + s.prefill_tokens);
    body += `<g data-step="${i}" data-decode="${s.decode_tokens}" data-prefill="${s.prefill_tokens}">` +
      `<rect class="bar" x="${x}" y="${yd.toFixed(1)}" width="${w}" height="${(H - BOTTOM - yd).toFixed(1)}"/>` +
      `<rect class="bar-hatched" x="${x}" y="${yt.toFixed(1)}" width="${w}" height="${(yd - yt).toFixed(1)}"/>` +
      `<title>${s.decode_tokens} decode, ${s.prefill_tokens} prompt tokens</title></g>`;
  });
  $("step-tokens").innerHTML = legend([["bar", "decode tokens"], ["hatched", "prompt tokens"]]) +
    svg(W, H, `tokens in the last ${shown.length} steps`, body);

  const all = shown.flatMap((s) => [s.measured_s, s.predicted_s, s.arithmetic_s, s.movement_s]);
  const time = logAxis(all.filter((v) => v !== null && v !== undefined));
  body = yAxis(time, seconds);
  const mid = (i) => x0(i) + slot / 2;
  shown.forEach((s, i) => {
    const y = time.y(s.measured_s);
    body += `<rect class="bar-light" data-measured="${s.measured_s}" x="${x0(i).toFixed(1)}" y="${y.toFixed(1)}" ` +
      `width="${Math.max(slot - 1, 0.5).toFixed(1)}" height="${(H - BOTTOM - y).toFixed(1)}">` +
      `<title>measured ${seconds(s.measured_s)}, price ${seconds(s.predicted_s)}</title></rect>`;
  });
  const line = (key) => shown.map((s, i) => (s[key] ? [mid(i), time.y(s[key])] : null));
  // The price first: uncalibrated, it is the higher floor, which stays visible on top of it.
  body += polyline("price", line("predicted_s")) + polyline("floor-arith", line("arithmetic_s")) +
    polyline("floor-move", line("movement_s"));
  $("step-times").innerHTML = legend([["light", "measured"], ["price", "cost model's price"],
    ["arith", "arithmetic floor (FLOPs ÷ peak FLOP/s)"], ["move", "movement floor (bytes ÷ bandwidth)"]]) +
    svg(W, H, `measured and priced times of the last ${shown.length} steps`, body);

  const priced = shown.filter((s) => s.predicted_s !== null);
  if (!shown.length) {
    $("step-summary").textContent = "No steps yet: send a request (the playground below will do).";
  } else if (!priced.length) {
    $("step-summary").textContent = `${shown.length} steps, none priced: the server has no hardware spec ` +
      "(run `quill cost calibrate` once, or start with --hardware FILE).";
  } else {
    const moving = priced.filter((s) => s.movement_s >= s.arithmetic_s).length;
    $("step-summary").textContent = `Last ${shown.length} steps: median measured ` +
      `${seconds(median(shown.map((s) => s.measured_s)))}, price ${seconds(median(priced.map((s) => s.predicted_s)))}; ` +
      `median efficiency against the roofline ${percent(median(priced.map((s) => s.efficiency)))}, ` +
      `MFU ${percent(median(priced.map((s) => s.mfu)))}, MBU ${percent(median(priced.map((s) => s.mbu)))}; ` +
      `${moving} of ${priced.length} bound by movement.`;
  }
  fillRows($("step-table"), steps.slice(-20).reverse().map((s) => [
    clock(s.at), count(s.decode_tokens), count(s.prefill_tokens), seconds(s.measured_s),
    seconds(s.predicted_s), seconds(s.arithmetic_s), seconds(s.movement_s), percent(s.efficiency),
    percent(s.mfu), percent(s.mbu)]));
}

function seriesCharts(series) {
  // The points move left as time passes: a redraw when one is added or every 5 s.
  const key = series.map((p) => p.output_tokens).join() + ":" + Math.floor(Date.now() / 5000);
  if (!changed($("series-tokens"), key)) return;
  const x = (at) => LEFT + (W - LEFT) * (1 + at / SERIES_S);
  const slot = (W - LEFT) * 5 / SERIES_S;
  const tokens = linearAxis(Math.max(1, ...series.map((p) => p.output_tokens_per_s)));
  let body = yAxis(tokens, (t) => t.toPrecision(2));
  for (const p of series) {
    const y = tokens.y(p.output_tokens_per_s);
    body += `<rect class="bar" data-tokens="${p.output_tokens}" x="${x(p.at).toFixed(1)}" y="${y.toFixed(1)}" ` +
      `width="${Math.max(slot - 1, 1).toFixed(1)}" height="${(H - BOTTOM - y).toFixed(1)}">` +
      `<title>${rate(p.output_tokens_per_s)} tokens/s, busy ${percent(p.busy_fraction)}</title></rect>`;
  }
  body += `<text x="${LEFT}" y="${H - 6}">${SERIES_S / 60} min ago</text><text x="${W}" y="${H - 6}" text-anchor="end">now</text>`;
  $("series-tokens").innerHTML = svg(W, H, "output tokens per second over the last minutes", body);
  const priced = series.filter((p) => p.usd_per_million_tokens !== null);
  if (!priced.length) {
    $("series-cost").innerHTML = '<p class="note">No dollars: no price per hour, or no tokens yet.</p>';
    return;
  }
  const cost = logAxis(priced.map((p) => p.usd_per_million_tokens));
  body = yAxis(cost, usd) + polyline("price", series.map((p) =>
    p.usd_per_million_tokens === null ? null : [x(p.at) + slot / 2, cost.y(p.usd_per_million_tokens)]));
  body += `<text x="${LEFT}" y="${H - 6}">${SERIES_S / 60} min ago</text><text x="${W}" y="${H - 6}" text-anchor="end">now</text>`;
  $("series-cost").innerHTML = svg(W, H, "dollars per million output tokens over the last minutes", body);
}

// -- the rest of the page ---------------------------------------------------------------------
function fillRows(table, rows) {
  const tbody = table.tBodies[0];
  const fresh = document.createElement("tbody");
  for (const cells of rows) {
    const tr = fresh.insertRow();
    for (const c of cells) tr.insertCell().textContent = c;
  }
  table.replaceChild(fresh, tbody);
}

function latency(id, dist) {
  const figure = $(id);
  if (!changed(figure, JSON.stringify(dist))) return;
  for (const cell of figure.querySelectorAll("[data-q]")) {
    const q = cell.dataset.q;
    cell.textContent = q === "count" ? count(dist.count) : seconds(dist[q]);
  }
  histogram(figure.querySelector("[data-chart]"), dist);
}

// Charts and tables are drawn only while their section is in (or near) view: a browser on the
// server's own 2-core machine redrawing the whole page twice a second measurably slowed its
// steps (docs/benchmarks.md, "The console open against closed").
const DRAW = {
  latency: (state) => { latency("ttft", state.ttft); latency("itl", state.itl); },
  steps: (state) => stepCharts(state.steps),
  series: (state) => seriesCharts(state.series),
  requests: (state) => changed($("requests"), requestsKey(state)) && fillRows($("requests"),
    state.requests.slice(0, REQUESTS_SHOWN).map((r) => [
    clock(r.finished_at), shortId(r.request_id), r.finish_reason, count(r.prompt_tokens),
    count(r.cached_tokens), count(r.output_tokens), seconds(r.ttft_s), seconds(r.mean_itl_s),
    seconds(r.e2e_s), si(r.flops, "FLOP"), si(r.bytes, "B"), usd(r.cost_usd)])),
};
const REQUESTS_SHOWN = 20; // of the 50 the state holds
function requestsKey(state) {
  return state.requests.length ? `${state.requests[0].request_id}:${state.finished_requests}` : "";
}
const visible = new Set();
let lastState = null;

function watchSections() {
  const observer = new IntersectionObserver((entries) => {
    for (const entry of entries) {
      const name = entry.target.dataset.draw;
      if (!entry.isIntersecting) { visible.delete(name); continue; }
      visible.add(name);
      if (lastState) DRAW[name](lastState);
    }
  }, { rootMargin: "200px" });
  for (const section of document.querySelectorAll("[data-draw]")) observer.observe(section);
}

function render(state) {
  const server = state.server;
  modelName = server.model;
  setText("server-line", `${server.model} · quill ${server.version} · ` +
    `priced on ${server.hardware || "no hardware spec"} · ` +
    (server.price_per_hour ? `$${server.price_per_hour}/hour` : "no price per hour") +
    ` · context up to ${count(server.max_model_len)} tokens`);
  $("logout").hidden = !server.api_key_required;
  setText("running", count(state.running));
  setText("waiting", count(state.waiting));
  setText("kv-usage", percent(state.kv_cache_usage));
  setText("prefix-hits", percent(state.prefix_cache_hit_rate));
  setText("preemptions", count(state.preemptions));
  const spec = state.spec_decode;
  setText("spec-decode", !spec ? "off" : spec.acceptance_rate === null ?
    `none yet (${spec.drafts_allowed})` :
    `${percent(spec.acceptance_rate)} of ${count(spec.draft_tokens)} (${spec.drafts_allowed})`);
  setText("finished", count(state.finished_requests));
  setText("tokens-per-s", `${rate(state.output_tokens_per_s_now)} · ${rate(state.output_tokens_per_s)}`);
  setText("usd-per-mtok", `${usd(state.usd_per_million_tokens_now)} · ${usd(state.usd_per_million_tokens)}`);
  setText("price-note", server.price_per_hour ? `At $${server.price_per_hour} per machine-hour, ` +
    "busy or idle." : "No price: start with --price-per-hour USD (or a hardware spec that has one) to see dollars.");
  lastState = state;
  for (const name of visible) DRAW[name](state);
  updates += 1;
  document.body.dataset.updates = String(updates);
  if (updates === 1) {
    performance.mark("console-ready");
    document.body.dataset.ready = "true";
  }
}

// The status region is announced by screen readers: only its changes (live, not updating)
// go there; the time of the last update goes beside it.
function setConnection(state, text, updated = "") {
  $("connection").dataset.state = state;
  setText("connection", text);
  setText("updated", updated);
}

async function poll() {
  const started = performance.now();
  if (!paused && !document.hidden) {
    try {
      const response = await fetch("/console/state", { cache: "no-store" });
      if (response.status === 401) { location.reload(); return; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      render(await response.json());
      setConnection("live", "live", `updated ${new Date().toLocaleTimeString("en-GB")}`);
    } catch (e) {
      setConnection("stale", `not updating: ${e.message}`);
    }
  }
  setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));
}

async function loadFigures() {
  const response = await fetch("/console/figures", { cache: "no-store" });
  if (!response.ok) return;
  const { directories, figures } = await response.json();
  const list = $("figures");
  list.replaceChildren();
  for (const f of figures) {
    const li = document.createElement("li");
    const a = document.createElement("a");
    a.href = f.url;
    const img = document.createElement("img");
    img.src = f.url;
    img.alt = `${f.name} from ${f.directory}`;
    img.loading = "lazy"; // decoded when scrolled to, not while the page starts
    a.append(img);
    const caption = document.createElement("p");
    caption.textContent = `${f.name} (${f.directory})`;
    li.append(a, caption);
    list.append(li);
  }
  $("figures-note").textContent = (figures.length ? `${figures.length} figures from ` : "No figures yet in ") +
    directories.join(", ") + ". `quill bench serve --plot DIR` and `quill bench experiments` write them; " +
    "`quill serve --console-figures DIR` links a directory.";
}

// -- the playground ---------------------------------------------------------------------------
function saveForm() {
  const form = $("play");
  const values = {};
  for (const el of form.elements) if (el.name) values[el.name] = el.type === "radio" ? form.elements[el.name].value : el.value;
  localStorage.setItem(FORM_KEY, JSON.stringify(values));
}
function restoreForm() {
  const form = $("play");
  let values = {};
  try { values = JSON.parse(localStorage.getItem(FORM_KEY) || "{}"); } catch { values = {}; }
  for (const [name, value] of Object.entries(values)) {
    const el = form.elements[name];
    if (el) el.value = value;
  }
}

function requestBody(form) {
  const f = new FormData(form);
  const chat = f.get("endpoint") === "chat";
  const body = {
    model: modelName, stream: true, stream_options: { include_usage: true },
    max_tokens: parseInt(f.get("max_tokens"), 10) || 64,
    temperature: parseFloat(f.get("temperature")), top_p: parseFloat(f.get("top_p")),
  };
  if (f.get("seed") !== "") body.seed = parseInt(f.get("seed"), 10);
  if (f.get("stop")) body.stop = [f.get("stop")];
  if (chat) {
    body.messages = [];
    if (f.get("system")) body.messages.push({ role: "system", content: f.get("system") });
    body.messages.push({ role: "user", content: f.get("prompt") });
  } else {
    body.prompt = f.get("prompt");
  }
  return { url: chat ? "/v1/chat/completions" : "/v1/completions", body, chat };
}

async function send(event) {
  event.preventDefault();
  const { url, body, chat } = requestBody($("play"));
  const reply = $("reply");
  reply.textContent = "";
  reply.setAttribute("aria-busy", "true"); // read out once whole, not chunk by chunk
  $("play-error").textContent = "";
  fillRows($("play-timings"), []);
  player = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const sent = performance.now();
  const arrivals = [];
  let usage = null, metrics = null, finish = null;
  try {
    const response = await fetch(url, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: player.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || `HTTP ${response.status}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new Error(chunk.error.message);
          const choice = chunk.choices && chunk.choices[0];
          const text = choice ? (chat ? choice.delta && choice.delta.content : choice.text) : null;
          if (text) { arrivals.push(performance.now()); reply.textContent += text; }
          if (choice && choice.finish_reason) finish = choice.finish_reason;
          if (chunk.usage) usage = chunk.usage;
          if (chunk.metrics) metrics = chunk.metrics;
        }
      }
    }
  } catch (e) {
    $("play-error").textContent = e.name === "AbortError" ? "Stopped." : `Error: ${e.message}`;
  } finally {
    player = null;
    reply.setAttribute("aria-busy", "false");
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  showTimings(sent, arrivals, usage, metrics, finish);
}

function showTimings(sent, arrivals, usage, metrics, finish) {
  const rows = [["finish reason", finish || "–"]];
  if (arrivals.length) {
    rows.push(["first text after (this browser)", seconds((arrivals[0] - sent) / 1000)]);
    const span = (arrivals[arrivals.length - 1] - arrivals[0]) / 1000;
    if (arrivals.length > 1) rows.push(["text chunks/s after the first (this browser)", rate((arrivals.length - 1) / span)]);
  }
  if (usage) rows.push(["prompt tokens", count(usage.prompt_tokens)], ["output tokens", count(usage.completion_tokens)]);
  if (metrics) {
    const m = metrics;
    rows.push(["queued (server)", seconds(m.queue_time)], ["TTFT (server)", seconds(m.time_to_first_token)],
      ["TTFT the server predicted", m.predicted_time_to_first_token ? seconds(m.predicted_time_to_first_token) : "–"],
      ["mean ITL (server)", seconds(m.mean_inter_token_latency)], ["max ITL (server)", seconds(m.max_inter_token_latency)],
      ["total (server)", seconds(m.e2e_latency)], ["cached prompt tokens", count(m.num_cached_tokens)],
      ["FLOPs", si(m.flops, "FLOP")], ["bytes moved", si(m.bytes_moved, "B")], ["cost", usd(m.cost_usd)]);
  }
  fillRows($("play-timings"), rows);
  $("play-timings").dataset.done = "true";
}

function start() {
  restoreForm();
  const form = $("play");
  form.addEventListener("submit", send);
  form.addEventListener("input", saveForm);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); form.requestSubmit(); }
  });
  $("stop").addEventListener("click", () => player && player.abort());
  $("pause").addEventListener("click", (e) => {
    paused = !paused;
    e.target.setAttribute("aria-pressed", String(paused));
    e.target.textContent = paused ? "Resume updates" : "Pause updates";
    if (paused) setConnection("paused", "paused");
  });
  $("logout").addEventListener("click", async () => {
    await fetch("/console/logout", { method: "POST" });
    location.reload();
  });
  watchSections();
  poll();
  loadFigures();
}

start();
