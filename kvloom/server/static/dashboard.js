// kvloom's live dashboard: listens to /dashboard/events (server-sent events, what
// changed since the version it has) and draws the engine's samples with uPlot and the
// scheduler's timeline as a row of step segments per request. window.kvloom.state is
// what the page knows; the browser tests read it.
"use strict";

const SAMPLES_KEPT = 1200;   // ten minutes at the server's 0.5 s samples
const TIMELINE_STEPS = 120;  // columns: the last steps any row touched
const TIMELINE_ROWS = 40;    // the most recent requests
const TIMELINE_PERIOD_MS = 500;  // the timeline redraws at most twice a second

const state = { version: 0, model: "", numBlocks: 0, samples: [], rows: new Map(), updates: 0,
                preemptions: 0, selected: null, drawnTimeline: 0 };  // preemptions: the engine's, since it started
window.kvloom = { state };

const $ = (id) => document.getElementById(id);
const fmt = (value, digits = 1) => value == null ? "–" : Number(value).toFixed(digits);

// ---- charts ---------------------------------------------------------------------------
function chart(id, title, series, scale) {
  const opts = {
    title, width: Math.max(360, $(id).clientWidth - 8), height: 180,
    scales: { x: { time: true }, y: scale || {} },
    series: [{}, ...series.map(([label, stroke]) => ({ label, stroke, width: 1.5, spanGaps: false }))],
    axes: [{}, { size: 50 }],
  };
  return new uPlot(opts, [[], ...series.map(() => [])], $(id));
}

const charts = {
  throughput: chart("chart-throughput", "Throughput (tokens/s)", [["output", "#22c55e"], ["prompt", "#3b82f6"]]),
  requests: chart("chart-requests", "Requests", [["running", "#22c55e"], ["waiting", "#f59e0b"],
                                                 ["preempted (per sample)", "#ef4444"]]),
  kv: chart("chart-kv", "KV blocks", [["held by requests", "#8b5cf6"], ["cached, idle", "#06b6d4"],
                                      ["pool", "#999"]]),
  hits: chart("chart-hits", "Prefix-cache hit rate", [["hit rate", "#0ea5e9"]], { range: [0, 1] }),
  ttft: chart("chart-ttft", "TTFT (s), last 5 min", [["p50", "#22c55e"], ["p90", "#f59e0b"], ["p99", "#ef4444"]]),
  itl: chart("chart-itl", "ITL (s), last 5 min", [["p50", "#22c55e"], ["p90", "#f59e0b"], ["p99", "#ef4444"]]),
};

function drawCharts() {
  const s = state.samples;
  const t = s.map((x) => x.t);
  const col = (f) => s.map(f);
  charts.throughput.setData([t, col((x) => x.output_tps), col((x) => x.prompt_tps)]);
  charts.requests.setData([t, col((x) => x.running), col((x) => x.waiting), col((x) => x.preempted)]);
  charts.kv.setData([t, col((x) => x.kv_used), col((x) => x.kv_cached), col(() => state.numBlocks)]);
  charts.hits.setData([t, col((x) => x.hit_rate)]);
  charts.ttft.setData([t, col((x) => x.ttft[0]), col((x) => x.ttft[1]), col((x) => x.ttft[2])]);
  charts.itl.setData([t, col((x) => x.itl[0]), col((x) => x.itl[1]), col((x) => x.itl[2])]);
}

function drawSummary() {
  const last = state.samples[state.samples.length - 1];
  $("model").textContent = state.model;
  $("stat-requests").textContent = state.rows.size;
  $("stat-preemptions").textContent = state.preemptions;
  if (!last) return;
  $("stat-output").textContent = fmt(last.output_tps);
  $("stat-prompt").textContent = fmt(last.prompt_tps);
  $("stat-running").textContent = last.running;
  $("stat-waiting").textContent = last.waiting;
  $("stat-kv").textContent = `${last.kv_used}/${state.numBlocks}`;
  $("stat-hits").textContent = last.hit_rate == null ? "–" : `${fmt(100 * last.hit_rate, 0)}%`;
}

// ---- the timeline ---------------------------------------------------------------------
function describe(segment) {
  const [first, last, kind, detail] = segment;
  const steps = first === last ? `step ${first}` : `steps ${first}-${last}`;
  const what = { prefill: `prefill, ${detail} tokens`, decode: `decode, ${detail} tokens`,
                 wait: `waited: ${detail}`, preempted: `preempted: ${detail}`,
                 finished: `finished: ${detail}` }[kind] || `${kind}: ${detail}`;
  return `${steps} · ${what}`;
}

function drawTimeline() {
  const lastOf = (row) => row.segments[row.segments.length - 1][1];
  const active = [...state.rows.values()].filter((row) => row.segments.length);
  const lastStep = Math.max(0, ...active.map(lastOf));
  const firstStep = Math.max(1, lastStep - TIMELINE_STEPS + 1);
  // The requests the window's steps touched, oldest first, the newest TIMELINE_ROWS.
  const rows = active.filter((row) => lastOf(row) >= firstStep);
  rows.sort((a, b) => a.segments[0][0] - b.segments[0][0] || a.id.localeCompare(b.id));
  const shown = rows.slice(-TIMELINE_ROWS);
  const width = lastStep - firstStep + 1;
  const html = shown.map((row) => {
    const segments = row.segments.filter((s) => s[1] >= firstStep).map((s) => {
      const left = (Math.max(s[0], firstStep) - firstStep) / width * 100;
      const span = (s[1] - Math.max(s[0], firstStep) + 1) / width * 100;
      return `<div class="seg ${s[2]}" style="left:${left}%;width:${span}%" title="${escapeHtml(describe(s))}"></div>`;
    }).join("");
    const selected = row.id === state.selected ? " selected" : "";
    return `<div class="tl-row${selected}" data-request-id="${escapeHtml(row.id)}" data-status="${escapeHtml(row.status)}">` +
           `<span class="tl-label" title="${escapeHtml(row.id)}">${escapeHtml(row.id)}</span>` +
           `<div class="tl-track">${segments}</div></div>`;
  }).join("");
  $("timeline").innerHTML = html || "<em>no requests yet</em>";
  $("timeline").dataset.firstStep = firstStep;
  $("timeline").dataset.lastStep = lastStep;
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

async function showDetail(requestId) {
  state.selected = requestId;
  drawTimeline();
  const response = await fetch(`/dashboard/requests/${encodeURIComponent(requestId)}`);
  const detail = $("detail");
  detail.hidden = false;
  if (!response.ok) {
    detail.textContent = `request ${requestId}: no longer kept`;
    return;
  }
  const row = await response.json();
  const facts = [["request", row.id], ["status", row.status], ["prompt tokens", row.prompt_tokens],
                 ["output tokens", row.output_tokens], ["cached prompt tokens", row.cached_tokens],
                 ["TTFT (s)", fmt(row.ttft, 3)]];
  detail.innerHTML =
    `<table>${facts.map(([k, v]) => `<tr><td>${k}</td><td><b>${escapeHtml(v ?? "–")}</b></td></tr>`).join("")}</table>` +
    `<ol class="events">${row.segments.map((s) => `<li class="event ${s[2]}-event">${escapeHtml(describe(s))}</li>`).join("")}</ol>`;
  detail.dataset.requestId = row.id;
}

$("timeline").addEventListener("click", (event) => {
  const row = event.target.closest(".tl-row");
  if (row) showDetail(row.dataset.requestId);
});

// ---- data -----------------------------------------------------------------------------
function merge(snapshot) {
  const kept = new Set(snapshot.row_ids);
  const changed = snapshot.samples.length || snapshot.rows.length || state.rows.size !== kept.size;
  if (!changed && state.updates) return;  // nothing new: leave the page (and its elements) as they are
  state.version = snapshot.version;
  state.model = snapshot.model;
  state.numBlocks = snapshot.num_blocks;
  for (const sample of snapshot.samples) state.samples.push(sample);
  if (snapshot.samples.length) state.preemptions = snapshot.samples[snapshot.samples.length - 1].preemptions_total;
  if (state.samples.length > SAMPLES_KEPT) state.samples.splice(0, state.samples.length - SAMPLES_KEPT);
  for (const row of snapshot.rows) state.rows.set(row.id, row);
  for (const id of [...state.rows.keys()]) if (!kept.has(id)) state.rows.delete(id);
  state.updates += 1;
  // Draw only what changed, the timeline at most every TIMELINE_PERIOD_MS: the page's
  // rendering is CPU time taken from the engine when both share a machine.
  drawSummary();
  if (snapshot.samples.length) drawCharts();
  if (snapshot.rows.length || !state.drawnTimeline) scheduleTimeline();
}

let timelineTimer = null;
function scheduleTimeline() {
  if (timelineTimer !== null) return;
  const wait = Math.max(0, (state.drawnTimeline || 0) + TIMELINE_PERIOD_MS - Date.now());
  timelineTimer = setTimeout(() => { timelineTimer = null; state.drawnTimeline = Date.now(); drawTimeline(); }, wait);
}

function listen() {
  const source = new EventSource(`/dashboard/events?since=${state.version}`);
  source.onopen = () => { $("connection").textContent = "live"; $("connection").className = "stat live"; };
  source.onmessage = (event) => merge(JSON.parse(event.data));
  source.onerror = () => {  // the server went away or restarts: reconnect from the version we have
    $("connection").textContent = "reconnecting…";
    $("connection").className = "stat lost";
    source.close();
    setTimeout(listen, 1000);
  };
}

listen();
