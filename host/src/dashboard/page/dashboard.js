// The dashboard's page: reads the run's history once, then one view per reading of the
// cluster from the server-sent events at /api/events, and draws it. Every text from the
// cluster goes in as text (never as HTML): policy labels and failures are a peer's words.
"use strict";

const $ = (id) => document.getElementById(id);
const HISTORY = 3600;
let points = [];
let drilled = null;
let started = null;

// An element with attributes and children (strings become text).
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "onclick") e.onclick = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

const fmt = (x, digits = 2) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

// The charts: each a uPlot of some of the points' fields against time.
const CHARTS = [
  { id: "chart-progress", series: [
    { field: "iterations_per_s", label: "iterations/s", stroke: "#2563eb" },
    { field: "waiting_share", label: "waiting share", stroke: "#dc2626", scale: "share" } ] },
  { id: "chart-waits", series: [
    { field: "deferred_per_s", label: "deferred pulls/s", stroke: "#d97706" },
    { field: "parked", label: "parked now", stroke: "#7c3aed" },
    { field: "held", label: "held now", stroke: "#059669" } ] },
  { id: "chart-loss", series: [
    { field: "train_loss", label: "training loss", stroke: "#2563eb" },
    { field: "test_loss", label: "test loss", stroke: "#7c3aed" },
    { field: "accuracy", label: "accuracy", stroke: "#059669", scale: "share" } ] },
  { id: "chart-traffic", format: (v) => bytes(v) + "/s", series: [
    { field: "server_bytes_per_s", label: "server bytes/s (sent + received)", stroke: "#0891b2" } ] },
  { id: "chart-staleness", series: [
    { field: "staleness_mean", label: "mean staleness", stroke: "#d97706" },
    { field: "clock_spread", label: "clock spread", stroke: "#2563eb", scale: "spread" } ] },
];
const charts = {};

function chartWidth(id) {
  return Math.max(300, $(id).clientWidth || 400);
}

function makeChart(spec) {
  const scales = { x: { time: false } };
  const axes = [{ label: "seconds" }, { scale: spec.series[0].scale || "y" }];
  if (spec.format) {
    axes[1].values = (u, vals) => vals.map((v) => (v === null ? "" : spec.format(v)));
    axes[1].size = 80;
  }
  for (const s of spec.series.slice(1)) {
    if (s.scale && !scales[s.scale]) {
      scales[s.scale] = s.scale === "share" ? { range: [0, 1] } : {};
      axes.push({ scale: s.scale, side: 1, grid: { show: false } });
    }
  }
  const opts = {
    width: chartWidth(spec.id), height: 200, scales, axes,
    series: [{ label: "t (s)" }].concat(spec.series.map((s) => ({
      label: s.label, stroke: s.stroke, width: 1.5, scale: s.scale || "y", spanGaps: true }))),
  };
  charts[spec.id] = new uPlot(opts, seriesData(spec), $(spec.id));
}

function seriesData(spec) {
  return [points.map((p) => p.t_s)].concat(
    spec.series.map((s) => points.map((p) => (p[s.field] === undefined ? null : p[s.field]))));
}

function drawCharts() {
  for (const spec of CHARTS) charts[spec.id].setData(seriesData(spec));
}

function histogram(id, h, asShare) {
  const max = Math.max(1, ...h.counts);
  const bars = h.counts.map((c) => el("div", { style: `height:${(100 * c) / max}%`, title: String(c) },
    el("span", {}, c ? String(c) : "")));
  $(id).replaceChildren(...bars);
  const axis = el("div", { class: "hist-axis" },
    el("span", {}, asShare ? pct(h.lo) : fmt(h.lo, 1)), el("span", {}, asShare ? pct(h.hi) : fmt(h.hi, 1)));
  $(id).after(axis);
  const next = axis.nextElementSibling;
  if (next && next.className === "hist-axis") next.remove();
}

function workerRow(r) {
  return el("tr", { class: "click", onclick: () => drill(r.worker), "data-worker": String(r.worker) },
    el("td", {}, String(r.worker)), el("td", {}, String(r.clock)), el("td", {}, fmt(r.speed)),
    el("td", {}, pct(r.waiting_share)), el("td", {}, fmt(r.step_ms, 1)), el("td", {}, fmt(r.loss, 3)));
}

function renderWorkers(w) {
  $("workers-summary").textContent =
    `${w.live} live, ${w.connected} connected, ${w.finished} finished of ${w.registered} registered; ` +
    `clocks ${w.clock[0]} / ${w.clock[1]} / ${w.clock[2]} (lowest / median / highest); ` +
    `median ${fmt(w.speed_median)} iterations/s; mean waiting ${pct(w.waiting_mean)}`;
  histogram("speed-hist", w.speed_hist, false);
  histogram("waiting-hist", w.waiting_hist, true);
  const many = w.all === null;
  $("workers-title").textContent = many ? `The ${w.slowest.length} slowest (of ${w.live})` : "Every live worker";
  fill(document.querySelector("#workers-table tbody"), (many ? w.slowest : w.all).map(workerRow));
  $("waiting-title").hidden = $("waiting-table").hidden = !many;
  fill(document.querySelector("#waiting-table tbody"), many ? w.most_waiting.map(workerRow) : []);
}

function renderCluster(v) {
  fill(document.querySelector("#servers tbody"), v.servers.map((s) =>
    el("tr", { class: s.lost || !s.answered ? "bad" : "" },
      el("td", {}, String(s.server)), el("td", {}, s.lost ? "lost" : s.answered ? "up" : "not answering"),
      el("td", {}, s.primaries.join(", ") || "–"), el("td", {}, s.backups.join(", ") || "–"),
      el("td", {}, bytes(s.bytes_sent)), el("td", {}, bytes(s.bytes_received)))));
  fill(document.querySelector("#shards tbody"), v.shards.map((s) =>
    el("tr", { class: s.quarantined ? "bad" : "", title: s.last_failure || "" },
      el("td", {}, String(s.shard)), el("td", {}, String(s.primary)),
      el("td", {}, s.backup === null ? "–" : String(s.backup)),
      el("td", {}, s.policy + (s.quarantined ? " (quarantined)" : "")),
      el("td", {}, String(s.parked)), el("td", {}, String(s.held)), el("td", {}, String(s.pushes)),
      el("td", {}, String(s.steps)), el("td", {}, String(s.pulls_deferred)), el("td", {}, fmt(s.staleness_mean)))));
}

function renderPolicy(v) {
  const p = v.policy;
  const config = p.config.map(([k, val]) => `${k}=${val}`).join(",");
  $("policy").textContent = p.label + (config ? ":" + config : "");
  $("policy").title = "sha256 " + p.sha256;
  $("swaps").textContent = String(p.swaps);
  $("running").textContent = p.running.map(([name, n]) => `${name} on ${n} shard${n === 1 ? "" : "s"}`).join("; ");
  fill($("swap-history"), v.swaps.map((s) =>
    el("li", {}, `${s.swap === 0 ? "start" : "swap " + s.swap} at ${fmt(s.t_s, 0)} s: ${s.policy}` +
      (s.config ? ":" + s.config : ""))));
  const pilot = $("pilot");
  pilot.hidden = !v.pilot;
  if (v.pilot) {
    pilot.textContent = `Cluster policy ${v.pilot.policy}: ${v.pilot.swaps} swaps asked` +
      (v.pilot.quarantined ? ", quarantined" : "") +
      (v.pilot.metrics.length ? "; " + v.pilot.metrics.map(([k, x]) => `${k} ${fmt(x, 3)}`).join(", ") : "");
  }
}

function render(v) {
  started = v.started_unix_ms;
  const p = v.point;
  if (!points.length || p.t_s > points[points.length - 1].t_s) {
    points.push(p);
    if (points.length > HISTORY) points.splice(0, points.length - HISTORY);
  }
  $("iterations").textContent = String(p.iterations);
  $("elapsed").textContent = `${fmt(v.t_s, 0)} s`;
  drawCharts();
  renderPolicy(v);
  renderWorkers(v.workers);
  renderCluster(v);
  fill($("events"), v.events.slice().reverse().map((e) =>
    el("li", { class: e.kind }, `${fmt(e.t_s, 0)} s  ${e.text}`)));
  if (drilled !== null) drill(drilled);
}

async function drill(id) {
  drilled = id;
  $("drill-id").value = String(id);
  const r = await fetch(`/api/worker/${id}`);
  const d = await r.json();
  $("worker-detail").hidden = false;
  if (!r.ok) {
    $("worker-detail-title").textContent = d.error;
    return;
  }
  const row = d.row;
  $("worker-detail-title").textContent =
    `Worker ${row.worker}${d.live ? "" : " (not live)"}: clock ${row.clock}, ${fmt(row.speed)} iterations/s, ` +
    `waiting ${pct(row.waiting_share)}, step ${fmt(row.step_ms, 1)} ms, loss ${fmt(row.loss, 3)}`;
  fill(document.querySelector("#worker-shards tbody"), d.shards.map(([s, c, w]) =>
    el("tr", {}, el("td", {}, String(s)), el("td", {}, String(c)), el("td", {}, fmt(w)))));
  const data = [d.series.map((x) => x.t_s), d.series.map((x) => x.speed), d.series.map((x) => x.waiting_share)];
  if (!charts.worker) {
    charts.worker = new uPlot({
      width: chartWidth("chart-worker"), height: 160,
      scales: { x: { time: false }, share: { range: [0, 1] } },
      axes: [{ label: "seconds" }, {}, { scale: "share", side: 1, grid: { show: false } }],
      series: [{ label: "t (s)" }, { label: "iterations/s", stroke: "#2563eb" },
        { label: "waiting share", stroke: "#dc2626", scale: "share" }],
    }, data, $("chart-worker"));
  } else {
    charts.worker.setData(data);
  }
}

async function swap(ev) {
  ev.preventDefault();
  const out = $("swap-result");
  const file = $("swap-file").files[0];
  const config = $("swap-config").value.trim();
  const spec = (file ? file.name : $("swap-builtin").value) + (config ? ":" + config : "");
  out.className = "";
  out.textContent = `swapping to ${spec}…`;
  try {
    const r = await fetch(`/api/swap?policy=${encodeURIComponent(spec)}`, {
      method: "POST",
      headers: { Authorization: `Bearer ${$("swap-token").value.trim()}`, "Content-Type": "application/wasm" },
      body: file ? await file.arrayBuffer() : null,
    });
    const a = await r.json();
    if (r.ok && a.outcome === "done") {
      out.className = "ok";
      out.textContent = `swap ${a.swap}: ${a.policy} now runs on all ${a.shards} shards`;
    } else if (r.ok) {
      out.className = "err";
      out.textContent = `swap ${a.swap}: ${a.policy} was committed, but not everywhere: ${a.failed}`;
    } else {
      out.className = "err";
      out.textContent = `not swapped: ${a.error || a.reason}`;
    }
  } catch (e) {
    out.className = "err";
    out.textContent = `not swapped: ${e}`;
  }
}

async function start() {
  // A token in the address's fragment (`#token=...`, as `syncopate local` prints it) fills the
  // field and leaves the address bar; the fragment never reaches the server.
  const token = new URLSearchParams(location.hash.slice(1)).get("token");
  if (token) {
    $("swap-token").value = token;
    history.replaceState(null, "", location.pathname);
  }
  const names = await (await fetch("/api/policies")).json();
  $("swap-builtin").replaceChildren(...names.map((n) => el("option", { value: n }, n)));
  points = await (await fetch("/api/history")).json();
  for (const spec of CHARTS) makeChart(spec);
  $("swap-form").addEventListener("submit", swap);
  $("drill-form").addEventListener("submit", (ev) => { ev.preventDefault(); drill(Number($("drill-id").value)); });
  window.addEventListener("resize", () => {
    for (const spec of CHARTS) charts[spec.id].setSize({ width: chartWidth(spec.id), height: 200 });
  });
  const events = new EventSource("/api/events");
  events.addEventListener("view", (e) => {
    $("conn").textContent = "live";
    $("conn").className = "conn live";
    render(JSON.parse(e.data));
  });
  events.onerror = () => {
    $("conn").textContent = "reconnecting…";
    $("conn").className = "conn lost";
  };
}

start();
