// The page of `unmask serve`: the playground (the canvas after every denoising step, from
// POST /v1/unmask/canvas) and the runs of --runs DIR (GET /api/runs, /api/runs/NAME).
// No libraries: the page works offline. Everything drawn from the server (run names, model
// names, tokens, error messages) goes in as text (textContent, setAttribute), never as HTML;
// the server's Content-Security-Policy forbids inline script and style besides.
"use strict";

const MASK = "\u2591";
const $ = (id) => document.getElementById(id);

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("key").value || localStorage.getItem("unmask-key") || "";
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

$("key").value = localStorage.getItem("unmask-key") || "";
$("key").addEventListener("change", () => localStorage.setItem("unmask-key", $("key").value));

for (const button of document.querySelectorAll("header button[data-tab]")) {
  button.addEventListener("click", () => showTab(button.dataset.tab));
}

function showTab(name) {
  for (const b of document.querySelectorAll("header button[data-tab]")) {
    b.classList.toggle("on", b.dataset.tab === name);
  }
  for (const s of document.querySelectorAll("main section")) s.classList.toggle("on", s.id === name);
  if (name === "runs") refreshRuns();
}

// ------------------------------------------------------------------------ playground

async function* serverEvents(response) {
  // the JSON payloads of a text/event-stream response ("data: {...}" lines)
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (line.startsWith("data: ")) yield JSON.parse(line.slice(6));
    }
  }
}

function drawCanvas(prompt, tokens, previous, step) {
  const box = $("canvas");
  box.textContent = "";
  const head = document.createElement("span");
  head.className = "prompt";
  head.textContent = prompt;
  box.appendChild(head);
  tokens.forEach((token, i) => {
    const span = document.createElement("span");
    if (token === null) {
      span.className = "mask";
      span.textContent = MASK;
    } else {
      span.className = token === "\u00b7" ? "tok eos" : "tok";
      if (previous && previous[i] === null) span.classList.add("new");
      span.textContent = token;
    }
    box.appendChild(span);
  });
  box.dataset.step = String(step);
  box.dataset.masks = String(tokens.filter((t) => t === null).length);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function unmask() {
  const prompt = $("prompt").value;
  const body = { prompt };
  const number = (id) => ($(id).value === "" ? null : Number($(id).value));
  if (number("max_tokens") !== null) body.max_tokens = number("max_tokens");
  if (number("temperature") !== null) body.temperature = number("temperature");
  const options = {};
  for (const id of ["block_length", "steps", "threshold"]) {
    if (number(id) !== null) options[id] = number(id);
  }
  if (Object.keys(options).length) body.unmask = options;
  $("status").textContent = "decoding...";
  $("run").disabled = true;
  try {
    const response = await fetch("/v1/unmask/canvas", {
      method: "POST", headers: headers(), body: JSON.stringify(body),
    });
    if (!response.ok) {
      const error = await response.json();
      $("status").textContent = "error: " + error.error.message;
      return;
    }
    let previous = null;
    for await (const event of serverEvents(response)) {
      if (event.error) {
        $("status").textContent = "error: " + event.error.message;
      } else if (event.done) {
        $("status").textContent = `done: ${event.finish_reason}, ${event.forwards} forward passes`;
        $("canvas").dataset.done = "1";
      } else {
        drawCanvas(prompt, event.canvas, previous, event.step);
        previous = event.canvas;
        $("status").textContent = `step ${event.step}`;
        await sleep(Number($("delay").value) || 0);
      }
    }
  } finally {
    $("run").disabled = false;
  }
}

$("run").addEventListener("click", () => {
  $("canvas").dataset.done = "";
  unmask();
});

// ---------------------------------------------------------------------------- runs

const fmt = (v, digits = 4) => (v === null || v === undefined ? "-" : Number(v).toFixed(digits));

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const s = Math.round(seconds);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
}

function svgElement(name, attributes) {
  const element = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [k, v] of Object.entries(attributes)) element.setAttribute(k, v);
  return element;
}

function drawCurves(name, curves) {
  // loss (blue) and eval loss (orange) by step, on shared axes
  const W = 320, H = 180, L = 42, B = 22, T = 8, R = 8;
  // a diverged step's loss arrives as null (JSON has no NaN): left out of the curve
  const finite = (series) => (series || []).filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
  curves = { loss: finite(curves.loss), eval_loss: finite(curves.eval_loss) };
  const all = [...curves.loss, ...curves.eval_loss];
  const box = document.createElement("div");
  box.className = "plot";
  box.dataset.run = name;
  const title = document.createElement("h3");
  title.textContent = name;  // a folder's name is data: never HTML
  box.appendChild(title);
  const svg = svgElement("svg", { width: W, height: H });
  box.appendChild(svg);
  if (!all.length) {
    box.appendChild(document.createTextNode("no steps logged yet"));
    return box;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const y0 = Math.min(...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  svg.appendChild(svgElement("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#9aa5b1" }));
  svg.appendChild(svgElement("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#9aa5b1" }));
  for (const [value, y] of [[y1, T + 8], [y0, H - B]]) {
    const label = svgElement("text", { x: 2, y });
    label.textContent = value.toFixed(3);
    svg.appendChild(label);
  }
  for (const [value, x, anchor] of [[x0, L, "start"], [x1, W - R, "end"]]) {
    const label = svgElement("text", { x, y: H - 6, "text-anchor": anchor });
    label.textContent = "step " + value;
    svg.appendChild(label);
  }
  for (const [key, color] of [["loss", "#2563eb"], ["eval_loss", "#ea580c"]]) {
    const points = curves[key].map((p) => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`);
    if (!points.length) continue;
    svg.appendChild(svgElement("polyline", {
      class: key, points: points.join(" "), fill: "none", stroke: color, "stroke-width": 1.6,
    }));
  }
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const [key, label] of [["loss", "loss"], ["eval_loss", "eval loss"]]) {
    const item = document.createElement("span");
    item.className = key;
    item.textContent = "\u2014 " + label;
    legend.appendChild(item);
  }
  box.appendChild(legend);
  return box;
}

let runsTimer = null;

async function refreshRuns() {
  clearTimeout(runsTimer);
  const response = await fetch("/api/runs", { headers: headers() });
  const data = await response.json();
  const tbody = document.querySelector("#runs-table tbody");
  if (!response.ok) {
    $("runs-note").textContent = data.error.message;
    return;
  }
  const rows = [], plots = [];  // built first, swapped in at once
  for (const run of data.runs) {
    const tr = document.createElement("tr");
    tr.dataset.run = run.name;
    const step = (run.step ?? "-") + (run.planned_steps ? "/" + run.planned_steps : "");
    const cells = [
      [run.name, ""], [run.status, run.status.split(" ")[0]], [step, "num"],
      [fmt(run.loss), "num"], [fmt(run.eval_loss), "num"], [fmt(run.tokens_per_second, 0), "num"],
      [duration(run.eta_seconds), "num"],
    ];
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    rows.push(tr);
    const curves = await (await fetch("/api/runs/" + encodeURIComponent(run.name), { headers: headers() })).json();
    plots.push(drawCurves(run.name, curves));
  }
  tbody.replaceChildren(...rows);
  $("plots").replaceChildren(...plots);
  $("runs-note").textContent = data.runs.length ? "" : "no run directories in the folder";
  document.body.dataset.runsLoaded = String(Date.now());
  if (data.runs.some((r) => r.status === "running")) runsTimer = setTimeout(refreshRuns, 5000);
}

fetch("/api/info", { headers: headers() }).then(async (response) => {
  if (!response.ok) return;
  const info = await response.json();
  $("model").textContent = info.model;
  $("tab-runs").style.display = info.runs ? "" : "none";
  if (location.hash === "#runs" && info.runs) showTab("runs");
});
