// tandem dashboard: reads /api/* (tandem/dashboard/app.py), redraws on server-sent `change` events.
// Hand-written SVG, no build step, no dependencies.
"use strict";

const state = { metrics: [], steps: [], fleet: { servers: [], events: [] }, run: {}, extra: [], view: "overview",
                trajFilter: {}, picked: null, colour: null };
const CURVES = [["reward/mean", "reward"], ["eval/accuracy", "eval accuracy"], ["train/loss", "loss"],
                ["ppo/kl_ref", "KL to the reference"], ["ppo/approx_kl", "KL (approx.)"],
                ["mismatch/mean", "|server − trainer| logprob, mean"], ["mismatch/max", "|server − trainer| logprob, max"]];
const TIMES = [["time/generation", "waiting for rollouts", "#4a6fd6"], ["time/train", "training", "#2a8a4a"],
               ["time/sync", "weight sync", "#d08a1e"]];
const STATE_COLOURS = { healthy: "#2a8a4a", warming: "#e0b030", joining: "#e0b030", suspect: "#e0733a", evicted: "#c23b3b" };
const STALE_COLOURS = ["#4a6fd6", "#7fa0f0", "#f0b35a", "#e0733a", "#c23b3b", "#8a1c1c"];

const $ = (sel) => document.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const fmt = (v) => v == null ? "–" : Math.abs(v) >= 1000 || (Math.abs(v) < 0.01 && v !== 0) ? Number(v).toExponential(2) : Number(v).toFixed(3).replace(/\.?0+$/, "");

async function get(path) {
  const resp = await fetch(path, { credentials: "same-origin" });
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status} ${await resp.text()}`);
  return resp.json();
}

// -- loading ----------------------------------------------------------------------------------------
async function refresh() {
  const [run, metrics, steps, fleet] = await Promise.all([
    get("/api/run"), get(`/api/metrics?since=${state.metrics.length}`), get(`/api/steps?since=${state.steps.length}`),
    get("/api/fleet")]);
  if (metrics.total < state.metrics.length) state.metrics = [];  // a resumed run rewrote its rows
  if (steps.total < state.steps.length) state.steps = [];
  state.metrics.push(...metrics.rows);
  state.steps.push(...steps.rows);
  state.run = run;
  state.fleet = fleet;
  render();
}

function render() {
  $("#run-name").textContent = state.run.name || "";
  const pill = $("#run-state");
  pill.textContent = state.run.running ? "running" : "finished";
  pill.className = "pill" + (state.run.running ? " running" : "");
  if (state.view === "overview") renderOverview();
  if (state.view === "fleet") renderFleet();
}

// -- charts -----------------------------------------------------------------------------------------
function svg(w, h, body) {
  return `<svg viewBox="0 0 ${w} ${h}" width="100%" preserveAspectRatio="none" style="height:${h}px">${body}</svg>`;
}

function lineChart(title, points) {  // points: [[step, value]]
  const W = 320, H = 130, L = 40, B = 16;
  if (!points.length) return "";
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = (x) => L + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - L - 4);
  const sy = (y) => 4 + (y1 > y0 ? (1 - (y - y0) / (y1 - y0)) : 0.5) * (H - B - 8);
  const path = points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
  const last = ys[ys.length - 1];
  return `<div class="chart" data-key="${esc(title.key)}"><h3>${esc(title.label)} <span>${fmt(last)} at step ${xs[xs.length - 1]}</span></h3>` +
    svg(W, H, `<line x1="${L}" y1="${H - B}" x2="${W}" y2="${H - B}" stroke="#ccd"/>` +
      `<text x="2" y="12">${fmt(y1)}</text><text x="2" y="${H - B}">${fmt(y0)}</text>` +
      `<text x="${L}" y="${H - 3}">${x0}</text><text x="${W - 30}" y="${H - 3}">${x1}</text>` +
      `<polyline fill="none" stroke="#4a6fd6" stroke-width="1.5" vector-effect="non-scaling-stroke" points="${path}"/>`) + "</div>";
}

function stackedBars(rows, series, H = 150) {  // rows: [{step, values: [..]}], series: [[label, colour]]
  const W = 1000, L = 40, B = 16;
  if (!rows.length) return `<p class="muted">No steps yet.</p>`;
  const top = Math.max(1e-9, ...rows.map((r) => r.values.reduce((a, b) => a + b, 0)));
  const bw = (W - L) / rows.length;
  let body = `<text x="2" y="12">${fmt(top)}</text><text x="2" y="${H - B}">0</text>`;
  rows.forEach((r, i) => {
    let y = H - B;
    r.values.forEach((v, k) => {
      const h = (v / top) * (H - B - 6);
      if (h > 0) body += `<rect x="${(L + i * bw).toFixed(2)}" y="${(y - h).toFixed(2)}" width="${Math.max(bw - (bw > 3 ? 1 : 0), 0.5).toFixed(2)}" height="${h.toFixed(2)}" fill="${series[k][1]}"><title>step ${r.step}: ${esc(series[k][0])} ${fmt(v)}</title></rect>`;
      y -= h;
    });
  });
  body += `<text x="${L}" y="${H - 3}">${rows[0].step}</text><text x="${W - 40}" y="${H - 3}">${rows[rows.length - 1].step}</text>`;
  const legend = series.map(([label, colour]) => `<span><i style="background:${colour}"></i>${esc(label)}</span>`).join("");
  return svg(W, H, body) + `<div class="legend">${legend}</div>`;
}

function renderOverview() {
  const rl = state.metrics.filter((r) => r.phase === "rl");
  const keys = new Set(rl.flatMap((r) => Object.keys(r).filter((k) => typeof r[k] === "number")));
  const wanted = [...CURVES.filter(([k]) => keys.has(k)), ...state.extra.map((k) => [k, k])];
  $("#curves").innerHTML = wanted.map(([key, label]) =>
    lineChart({ key, label }, rl.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]))).join("");
  const select = $("#more-keys");
  const offered = [...keys].filter((k) => !["step", "time"].includes(k) && !wanted.some(([w]) => w === k)).sort();
  if (select.options.length - 1 !== offered.length)
    select.innerHTML = `<option value="">metric…</option>` + offered.map((k) => `<option>${esc(k)}</option>`).join("");
  const timed = rl.filter((r) => TIMES.some(([k]) => typeof r[k] === "number"));
  $("#timeline").innerHTML = stackedBars(timed.map((r) => ({ step: r.step, values: TIMES.map(([k]) => r[k] || 0) })),
    TIMES.map(([, label, colour]) => [label, colour]));
  const most = Math.max(0, ...state.steps.flatMap((s) => Object.keys(s.staleness).map(Number)));
  const levels = [...Array(Math.min(most, STALE_COLOURS.length - 1) + 1).keys()];
  $("#staleness").innerHTML = stackedBars(state.steps.map((s) => ({
    step: s.step, values: levels.map((l) => l < levels.length - 1 ? (s.staleness[l] || 0)
      : Object.entries(s.staleness).filter(([k]) => Number(k) >= l).reduce((a, [, n]) => a + n, 0)) })),
  levels.map((l) => [l === levels.length - 1 && most > l ? `${l}+ behind` : `${l} behind`, STALE_COLOURS[l]]), 120);
}

// -- fleet ------------------------------------------------------------------------------------------
function renderFleet() {
  const servers = [...state.fleet.servers].sort((a, b) => a.address.localeCompare(b.address));
  const counts = {};
  servers.forEach((s) => { counts[s.state] = (counts[s.state] || 0) + 1; });
  $("#fleet-summary").textContent = `${servers.length} server(s): ` +
    Object.entries(counts).map(([k, n]) => `${n} ${k}`).join(", ") +
    (state.fleet.time ? ` — as of ${new Date(state.fleet.time * 1000).toLocaleTimeString()}, step ${state.fleet.step}` : "");
  $("#fleet-table tbody").innerHTML = servers.map((s) => `<tr data-address="${esc(s.address)}">` +
    `<td>${esc(s.address)}</td><td><span class="state state-${esc(s.state)}">${esc(s.state)}</span></td>` +
    `<td class="num">${s.version ?? "–"}</td><td class="num">${s.in_flight ?? 0}</td><td class="num">${s.tokens_served ?? 0}</td>` +
    `<td>${esc(s.last_error || "")}</td></tr>`).join("");
  const seen = [...new Set(state.fleet.steps.flatMap((r) => Object.keys(r.states)))];
  $("#fleet-history").innerHTML = stackedBars(state.fleet.steps.map((r) => ({ step: r.step, values: seen.map((k) => r.states[k] || 0) })),
    seen.map((k) => [k, STATE_COLOURS[k] || "#888"]), 100);
  const rows = state.fleet.steps;
  const newest = (r) => Math.max(...Object.keys(r.versions).map(Number).filter((v) => !Number.isNaN(v)));
  $("#fleet-curves").innerHTML = [
    lineChart({ key: "fleet/in_flight", label: "requests in flight at a step's end" }, rows.map((r) => [r.step, r.in_flight])),
    lineChart({ key: "fleet/tokens", label: "tokens served during the step" },
      rows.slice(1).map((r, k) => [r.step, r.tokens_served - rows[k].tokens_served])),
    lineChart({ key: "fleet/at_newest", label: "servers at the newest weight version" },
      rows.map((r) => [r.step, r.versions[String(newest(r))] || 0])),
  ].join("");
  $("#fleet-events-count").textContent = state.fleet.events_total > state.fleet.events.length
    ? `the last ${state.fleet.events.length} of ${state.fleet.events_total}` : "";
  $("#fleet-events tbody").innerHTML = [...state.fleet.events].reverse().map((e) =>
    `<tr><td>${new Date(e.time * 1000).toLocaleTimeString()}</td><td class="num">${e.step}</td><td>${esc(e.address)}</td>` +
    `<td><span class="state state-${esc(e.state)}">${esc(e.state)}</span></td><td class="num">${e.version ?? "–"}</td>` +
    `<td>${esc(e.last_error || "")}</td></tr>`).join("");
}

// -- trajectories -----------------------------------------------------------------------------------
async function loadTrajectories() {
  const q = new URLSearchParams(Object.entries(state.trajFilter).filter(([, v]) => v !== ""));
  q.set("limit", "200");
  const page = await get(`/api/trajectories?${q}`);
  $("#traj-count").textContent = `${page.total} trajectories`;
  $("#traj-list tbody").innerHTML = page.rows.map((r) =>
    `<tr data-step="${r.step}" data-i="${r.i}"><td class="num">${r.step}</td><td class="num">${r.i}</td>` +
    `<td class="num">${fmt(r.reward)}</td><td class="num">${r.staleness}</td><td class="num">${r.tokens}</td>` +
    `<td class="num">${r.turns}</td></tr>`).join("");
}

function tokenColour(t, k, mode) {
  if (mode === "mismatch") {  // |server - trainer| on a log scale: 1e-4 clear, 1 full red
    const trainer = t.trainer_logprobs && t.trainer_logprobs[k];
    if (trainer == null) return "transparent";
    const d = Math.abs(t.logprobs[k] - trainer);
    return `rgba(200,40,40,${Math.min(1, Math.max(0, (Math.log10(d + 1e-12) + 4) / 4)).toFixed(2)})`;
  }
  if (mode === "logprob") {  // low probability: red
    const p = Math.exp(t.logprobs[k]);
    return `rgba(200,40,40,${(0.6 * (1 - p)).toFixed(2)})`;
  }
  const behind = t.version - t.versions[k];
  return behind <= 0 ? "transparent" : STALE_COLOURS[Math.min(behind + 1, STALE_COLOURS.length - 1)] + "55";
}

function tokenTitle(t, k) {
  const trainer = t.trainer_logprobs && t.trainer_logprobs[k];
  return `version ${t.versions[k]}, server logprob ${t.logprobs[k].toFixed(5)}` + (trainer == null ? "" :
    `, trainer logprob ${trainer.toFixed(5)}, |server − trainer| ${Math.abs(t.logprobs[k] - trainer).toExponential(2)}`);
}

async function showTrajectory(step, i) {
  const t = await get(`/api/trajectory?step=${step}&i=${i}`);
  state.picked = t;
  const mode = state.colour === "mismatch" && !t.trainer_logprobs ? "version"
    : state.colour || (t.trainer_logprobs ? "mismatch" : "version");
  const segments = [];  // runs of equal mask: context (0) or a model call (1)
  t.mask.forEach((m, k) => {
    if (!segments.length || segments[segments.length - 1].mask !== m) segments.push({ mask: m, tokens: [] });
    segments[segments.length - 1].tokens.push(k);
  });
  let call = 0;
  const html = segments.map((seg, n) => {
    const spans = seg.tokens.map((k) => seg.mask
      ? `<span style="background:${tokenColour(t, k, mode)}" title="${tokenTitle(t, k)}">${esc(t.pieces[k])}</span>`
      : `<span class="prompt">${esc(t.pieces[k])}</span>`).join("");
    const head = seg.mask ? `call ${++call}` : n === 0 ? "prompt" : "context (tool output, next turn)";
    return `<div class="${seg.mask ? "call" : "context"}"><div class="muted">${head}</div><div class="tokens">${spans}</div></div>`;
  }).join("");
  $("#traj-detail").innerHTML =
    `<div class="facts"><span>step <b>${t.step}</b></span><span>reward <b class="reward">${fmt(t.reward)}</b></span>` +
    `<span>staleness <b>${t.staleness}</b></span><span>turns <b>${t.turns}</b></span><span>finish <b>${esc(t.finish.join(", "))}</b></span>` +
    `<label>colour by <select id="colour">${t.trainer_logprobs ? `<option value="mismatch">|server − trainer| logprob</option>` : ""}<option value="version">weight version</option><option value="logprob">server logprob</option></select></label>` +
    (t.trainer_logprobs ? "" : `<span class="muted">trainer logprobs not recorded (dashboard.trainer_logprobs=true records them)</span>`) + `</div>` +
    html + `<details><summary>completion as text</summary><pre class="completion">${esc(t.completion)}</pre></details>`;
  $("#colour").value = mode;
  $("#colour").onchange = (e) => { state.colour = e.target.value; showTrajectory(step, i); };
  document.querySelectorAll("#traj-list tr").forEach((tr) =>
    tr.classList.toggle("picked", tr.dataset.step === String(step) && tr.dataset.i === String(i)));
}

// -- wiring -----------------------------------------------------------------------------------------
function show(view) {
  state.view = view;
  document.querySelectorAll(".view").forEach((s) => { s.hidden = s.id !== view; });
  document.querySelectorAll("nav button").forEach((b) => b.classList.toggle("active", b.dataset.view === view));
  if (view === "trajectories") loadTrajectories();
  render();
}

document.querySelectorAll("nav button").forEach((b) => { b.onclick = () => show(b.dataset.view); });
$("#more-keys").onchange = (e) => { if (e.target.value) state.extra.push(e.target.value); renderOverview(); };
$("#filters").onsubmit = (e) => {
  e.preventDefault();
  state.trajFilter = Object.fromEntries(new FormData(e.target));
  loadTrajectories();
};
$("#traj-list tbody").onclick = (e) => {
  const tr = e.target.closest("tr");
  if (tr) showTrajectory(Number(tr.dataset.step), Number(tr.dataset.i));
};

let pending = null;
function onChange() {  // coalesce bursts of events into one refresh
  if (pending) return;
  pending = setTimeout(() => { pending = null; refresh().catch(console.error); }, 100);
}
refresh().then(() => { document.body.dataset.loaded = "1"; }).catch((err) => {
  document.querySelector("main").innerHTML = `<p class="muted">${esc(err.message)}</p>`;
});
new EventSource("/api/events").addEventListener("change", onChange);
if (location.hash.slice(1)) show(location.hash.slice(1));
