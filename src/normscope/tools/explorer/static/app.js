// normscope explorer page: builds the controls from GET /api/layers, asks POST /api/scope for a worked
// example, draws the cube (faces computed by the server, normscope.tools.viz.cube_faces) and one grid per
// sample in SVG, and highlights the scope of the hovered element. No dependencies, works offline.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
let INFO = null;      // GET /api/layers
let DATA = null;      // the last good POST /api/scope response
let CELLS = new Map(); // scope id -> [svg elements]
let HL = null;        // highlighted scope id
let seq = 0;          // ignore responses to superseded requests

function el(name, attrs, parent) {
  const e = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(3);
  return v.toFixed(4);
}

function showError(msg) {
  const e = $("error");
  if (msg) { e.textContent = msg; e.hidden = false; } else { e.textContent = ""; e.hidden = true; }
}

function parseList(text) {
  const t = text.trim();
  if (t === "") return null;
  // send what the user typed when it is not a list of integers: the server names the problem
  const parts = t.split(/[\s,x×]+/).filter((s) => s !== "");
  return parts.map((s) => (/^-?\d+$/.test(s) ? Number(s) : s));
}

function request() {
  const eps = Number($("eps").value);
  return {
    layer: $("layer").value,
    layout: $("layout").value,
    shape: parseList($("shape").value) || [],
    groups: Number($("groups").value),
    mask: parseList($("mask").value),
    eps: Number.isFinite(eps) ? eps : $("eps").value,
    seed: Number($("seed").value),
  };
}

async function update() {
  const my = ++seq;
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), 10000);
  document.body.dataset.state = "loading";
  try {
    const r = await fetch("/api/scope", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request()), signal: ctl.signal,
    });
    const body = await r.json().catch(() => ({ error: `server answered ${r.status} without JSON` }));
    if (my !== seq) return;
    if (!r.ok) { showError(`${body.error || "request failed"} (HTTP ${r.status})`); document.body.dataset.state = "error"; return; }
    showError(null);
    DATA = body;
    render();
    document.body.dataset.state = "ready";
  } catch (e) {
    if (my !== seq) return;
    showError(e.name === "AbortError" ? "the server did not answer within 10 s" : `cannot reach the server: ${e.message}`);
    document.body.dataset.state = "error";
  } finally {
    clearTimeout(timer);
  }
}

let debounce = null;
function schedule() { clearTimeout(debounce); debounce = setTimeout(update, 150); }

// -- drawing --------------------------------------------------------------------------------------------

function cellClass(i) {
  return DATA.scope_ids[i] < 0 ? "cell pad" : "cell";
}

function hatch(svg) {
  // padding: grey with diagonal lines, as in the static pictures
  const defs = el("defs", {}, svg);
  const p = el("pattern", { id: `hatch-${svg.id}`, patternUnits: "userSpaceOnUse", width: 0.25, height: 0.25, patternTransform: "rotate(45)" }, defs);
  el("rect", { width: 0.25, height: 0.25, fill: "#d9d9d9" }, p);
  el("line", { x1: 0, y1: 0, x2: 0, y2: 0.25, stroke: "#8a8a8a", "stroke-width": 0.05 }, p);
}

function register(node, i) {
  node.dataset.i = i;
  const id = DATA.scope_ids[i];
  node.dataset.id = id;
  if (id < 0) node.setAttribute("fill", `url(#hatch-${node.ownerSVGElement.id})`);
  if (id >= 0) {
    node.setAttribute("fill", DATA.colors[id]);
    if (!CELLS.has(id)) CELLS.set(id, []);
    CELLS.get(id).push(node);
  }
}

function cellText(i) {
  const mode = $("celltext").value;
  if (mode === "x") return fmt2(DATA.values[i]);
  if (mode === "y") return DATA.scope_ids[i] < 0 ? "" : fmt2(DATA.output[i]);
  if (mode === "id") return DATA.scope_ids[i] < 0 ? "pad" : String(DATA.scope_ids[i]);
  return null;
}
const fmt2 = (v) => v.toFixed(2);

function drawCube() {
  const svg = $("cube");
  svg.replaceChildren();
  hatch(svg);
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  for (const f of DATA.faces) for (const [x, y] of f.points) {
    x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
  }
  const pad = 1.2, padLeft = 3.0; // room for the vertical axis label
  const W = x1 - x0 + pad + padLeft, H = y1 - y0 + 2 * pad;
  svg.setAttribute("viewBox", `${x0 - padLeft} ${-(y1 + pad)} ${W} ${H}`);
  const scale = Math.min(46, 380 / W);
  svg.setAttribute("width", Math.round(W * scale));
  svg.setAttribute("height", Math.round(H * scale));
  for (const f of DATA.faces) {
    const pts = f.points.map(([x, y]) => `${x},${-y}`).join(" ");
    const p = el("polygon", { points: pts, class: `${cellClass(f.index)} face-${f.face}` }, svg);
    register(p, f.index);
  }
  // axis names: horizontal under the front face, vertical left of it, depth along the top-left edge
  const [a0, a1, a2] = DATA.picture_shape;
  const [n0, n1, n2] = DATA.axes;
  const nchw = DATA.layout === "nchw";
  const nh = nchw ? a1 : a2, nv = nchw ? a2 : a1;
  const hlab = nchw ? n1 : n2, vlab = nchw ? n2 : n1;
  el("text", { x: nh / 2, y: 0.75, class: "axis", "text-anchor": "middle" }, svg).textContent = `${hlab} = ${nh}`;
  el("text", { x: -0.25, y: -nv / 2, class: "axis", "text-anchor": "end", "dominant-baseline": "middle" }, svg).textContent = `${vlab} = ${nv}`;
  el("text", { x: 0.62 * a0 / 2 - 0.3, y: -(nv + 0.42 * a0 / 2) - 0.15, class: "axis", "text-anchor": "end" }, svg).textContent = `${n0} = ${a0}`;
}

function drawSlices() {
  const svg = $("slices");
  svg.replaceChildren();
  hatch(svg);
  const [a0, a1, a2] = DATA.picture_shape;
  const nchw = DATA.layout === "nchw";
  const rows = nchw ? a2 : a1, cols = nchw ? a1 : a2;
  const [n0, n1, n2] = DATA.axes;
  const hlab = nchw ? n1 : n2, vlab = nchw ? n2 : n1;
  const gap = 1.0, top = 1.0, left = 2.2;
  const W = left + a0 * (cols + gap), H = top + rows + 1.0;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const scale = Math.max(8, Math.min(44, 820 / W, 420 / H));
  svg.setAttribute("width", Math.round(W * scale));
  svg.setAttribute("height", Math.round(H * scale));
  const showText = $("celltext").value !== "none" && scale >= 20;
  for (let n = 0; n < a0; n++) {
    const ox = left + n * (cols + gap);
    el("text", { x: ox + cols / 2, y: 0.7, class: "axis", "text-anchor": "middle" }, svg).textContent = `${n0} = ${n}`;
    for (let r = 0; r < rows; r++) for (let c = 0; c < cols; c++) {
      const i = nchw ? (n * a1 + c) * a2 + r : (n * a1 + r) * a2 + c;
      const rect = el("rect", { x: ox + c, y: top + r, width: 1, height: 1, class: cellClass(i) }, svg);
      register(rect, i);
      if (showText) {
        const t = cellText(i);
        if (t !== null) el("text", { x: ox + c + 0.5, y: top + r + 0.6, class: "val", "text-anchor": "middle", "data-for": i }, svg).textContent = t;
      }
    }
    el("text", { x: ox + cols / 2, y: top + rows + 0.7, class: "axis", "text-anchor": "middle" }, svg).textContent = hlab;
  }
  el("text", { x: left - 0.25, y: top + rows / 2, class: "axis", "text-anchor": "end", "dominant-baseline": "middle" }, svg).textContent = vlab;
  $("slices-title").textContent = nchw ? `one ${vlab} × ${hlab} grid per sample` : `one ${vlab} × ${hlab} grid per sequence (rows are tokens)`;
}

function drawStats() {
  const body = $("stats").querySelector("tbody");
  body.replaceChildren();
  // the column names say what the numbers are: "mean square" and "1/rms" for an uncentered scope,
  // as `normscope explain rms` prints them
  const centered = DATA.resolved.centered;
  $("stats-mean").textContent = centered ? "mean" : "mean (none: uncentered)";
  $("stats-var").textContent = centered ? "var" : "mean square";
  $("stats-r").textContent = centered ? "1/√(var+eps)" : "1/rms = 1/√(mean square+eps)";
  const seen = [];
  const have = new Set();
  for (const id of DATA.scope_ids) if (id >= 0 && !have.has(id)) { have.add(id); seen.push(id); }
  const MAX = 48;
  for (const id of seen.slice(0, MAX)) {
    const tr = document.createElement("tr");
    tr.dataset.id = id;
    const r = 1 / Math.sqrt(DATA.var[id] + DATA.eps);
    // an uncentered (RMS) scope has no mean: its "var" is the mean square, r is 1/rms
    const meanCell = DATA.resolved.centered ? fmt(DATA.mean[id]) : "—";
    tr.innerHTML = `<td><span class="swatch"></span>#${id}</td><td>${DATA.count[id]}</td><td>${meanCell}</td><td>${fmt(DATA.var[id])}</td><td>${fmt(r)}</td>`;
    // CSP forbids inline style attributes; the CSSOM is allowed
    tr.querySelector(".swatch").style.background = DATA.colors[id];
    tr.addEventListener("mouseenter", () => highlight(id, null));
    body.appendChild(tr);
  }
  if (seen.length > MAX) {
    const tr = document.createElement("tr");
    tr.innerHTML = `<td colspan="5" class="muted">… ${seen.length - MAX} more scopes</td>`;
    body.appendChild(tr);
  }
}

function render() {
  CELLS = new Map();
  drawCube();
  drawSlices();
  drawStats();
  $("note").innerHTML = "";
  const b = document.createElement("b");
  b.textContent = DATA.title;
  $("note").append(b, `: ${DATA.note}. `, `${DATA.n_scopes} scopes on shape (${DATA.shape.join(", ")}).`);
  const ok = DATA.check.max_abs_diff < 1e-4;
  $("check").innerHTML = "";
  const s = document.createElement("span");
  s.className = ok ? "ok" : "bad";
  s.id = "check-diff";
  s.textContent = `${ok ? "✓" : "✗"} output matches ${DATA.check.against}: max |Δ| = ${DATA.check.max_abs_diff.toExponential(2)}`;
  $("check").appendChild(s);
  $("scope").textContent = `engine scope: ${DATA.scope} → reduce axes (${DATA.resolved.reduce.join(", ")}), ` +
    `${DATA.resolved.groups > 1 ? DATA.resolved.groups + " groups on axis " + DATA.resolved.group_dim + ", " : ""}` +
    `statistics shaped (${DATA.resolved.stat_shape.join(", ")})${DATA.resolved.centered ? "" : ", uncentered (mean square)"}`;
  const first = DATA.scope_ids.findIndex((v) => v >= 0);
  highlight(first >= 0 ? DATA.scope_ids[first] : null, first >= 0 ? first : null);
}

// -- hover ------------------------------------------------------------------------------------------------

function index(i) {
  const out = [];
  let r = i;
  for (let k = DATA.shape.length - 1; k >= 0; k--) { out.unshift(r % DATA.shape[k]); r = Math.floor(r / DATA.shape[k]); }
  return out;
}

function highlight(id, i) {
  for (const svg of [$("cube"), $("slices")]) {
    for (const e of svg.querySelectorAll(".cell.hl, .cell.cur")) e.classList.remove("hl", "cur");
  }
  for (const t of $("slices").querySelectorAll("text.val.on-hl")) t.classList.remove("on-hl");
  HL = id;
  if (id !== null && id >= 0) {
    for (const e of CELLS.get(id) || []) e.classList.add("hl");
    for (const e of $("slices").querySelectorAll(".cell.hl")) {
      const t = $("slices").querySelector(`text.val[data-for="${e.dataset.i}"]`);
      if (t) t.classList.add("on-hl");
    }
  }
  for (const tr of $("stats").querySelectorAll("tbody tr")) tr.classList.toggle("hl", Number(tr.dataset.id) === id);
  if (i !== null && i !== undefined) {
    for (const e of document.querySelectorAll(`.cell[data-i="${i}"]`)) e.classList.add("cur");
    showInfo(i);
  }
}

function span(id, text) { const s = document.createElement("span"); s.id = id; s.textContent = text; return s; }

function showInfo(i) {
  const info = $("info");
  info.replaceChildren();
  const id = DATA.scope_ids[i];
  const x = DATA.values[i];
  const where = `x[${index(i).join(", ")}]`;
  if (id < 0) {
    info.append(`${where} = `, span("info-x", fmt(x)), " is padding: it enters no statistic.");
    info.dataset.i = i; info.dataset.id = -1;
    return;
  }
  const mean = DATA.mean[id], v = DATA.var[id], y = DATA.output[i];
  const line1 = document.createElement("div");
  const b = document.createElement("b"); b.append("scope #", span("info-id", String(id)));
  line1.append(`${where} = `, span("info-x", fmt(x)), " belongs to ", b, " with ", span("info-count", String(DATA.count[id])));
  if (DATA.resolved.centered) line1.append(" elements: mean = ", span("info-mean", fmt(mean)), ", variance = ", span("info-var", fmt(v)));
  else line1.append(" elements: no mean (uncentered), mean square = ", span("info-var", fmt(v)));
  const line2 = document.createElement("div");
  const f = document.createElement("span"); f.className = "formula";
  f.textContent = DATA.resolved.centered
    ? `y = (x − mean) / √(var + eps) = (${fmt(x)} − ${fmt(mean)}) / √(${fmt(v)} + ${DATA.eps}) = `
    : `y = x / rms = x / √(mean square + eps) = ${fmt(x)} / √(${fmt(v)} + ${DATA.eps}) = `;
  f.appendChild(span("info-y", fmt(y)));
  line2.appendChild(f);
  info.append(line1, line2);
  info.dataset.i = i; info.dataset.id = id;
}

function onHover(ev) {
  const t = ev.target.closest(".cell");
  if (!t || !DATA) return;
  const i = Number(t.dataset.i);
  highlight(DATA.scope_ids[i] >= 0 ? DATA.scope_ids[i] : null, i);
  ev.currentTarget.classList.add("hovering");
}

// -- controls ---------------------------------------------------------------------------------------------

function syncLayers() {
  const layout = $("layout").value;
  for (const o of $("layer").options) {
    const spec = INFO.layers.find((l) => l.name === o.value);
    o.disabled = !spec.layouts.includes(layout);
  }
  if ($("layer").selectedOptions[0].disabled) $("layer").value = "layer";
}

async function init() {
  try {
    const r = await fetch("/api/layers");
    INFO = await r.json();
  } catch (e) {
    showError(`cannot reach the server: ${e.message}`);
    return;
  }
  for (const l of INFO.layers) {
    const o = document.createElement("option");
    o.value = l.name; o.textContent = l.title; o.title = l.note;
    $("layer").appendChild(o);
  }
  $("layer").value = INFO.defaults.layer;
  $("layout").addEventListener("change", () => {
    $("shape").value = INFO.defaults.shape[$("layout").value].join(",");
    $("mask").value = "";
    syncLayers();
    schedule();
  });
  for (const id of ["layer", "shape", "groups", "mask", "eps", "seed"]) {
    $(id).addEventListener("input", schedule);
    $(id).addEventListener("change", schedule);
  }
  $("celltext").addEventListener("change", () => { if (DATA) render(); });
  $("controls").addEventListener("submit", (e) => { e.preventDefault(); update(); });
  for (const svg of [$("cube"), $("slices")]) {
    svg.addEventListener("mouseover", onHover);
    svg.addEventListener("mouseleave", () => svg.classList.remove("hovering"));
  }
  syncLayers();
  update();
}

document.addEventListener("DOMContentLoaded", init);
