// The runs of --runs DIR (common.js holds the shared helpers): a table of the runs, and one
// chart per chosen metric of metrics.jsonl (GET /api/runs/NAME serves every numeric key),
// every shown run overlaid in its own colour, with a legend. What the user chose (the
// metrics, the runs shown, the filter, each chart's scale) lives in `runsView` and
// survives the refresh every 5 s while a run is running. Run names and metric keys are
// data: they go in as text (textContent, setAttribute), never as HTML. All in one function
// scope: the page's scripts share one global scope, and only refreshRuns is put in it.
"use strict";

(() => {

const RUN_COLORS = ["#2563eb", "#ea580c", "#16a34a", "#dc2626", "#7c3aed",
  "#0891b2", "#ca8a04", "#db2777", "#4b5563", "#65a30d"];
// shown until the user picks metrics (those a run logged)
const DEFAULT_METRICS = ["loss", "eval_loss", "heldout_exact_match"];
const METRIC_NAMES = new Map([
  ["loss", "loss"], ["eval_loss", "eval loss"], ["heldout_exact_match", "held-out exact match"],
  ["learning_rate", "learning rate"], ["tokens_per_second", "tokens/s"], ["mfu", "MFU"],
  ["grad_norm", "gradient norm"], ["moe_load_max_over_mean", "expert load (max / mean)"],
]);
const FRACTIONS = new Set(["heldout_exact_match"]);  // drawn from 0% to 100%
const WIDE = 30;  // a positive metric whose max / min reaches this gets a log axis (as `unmask plot`)
const MARKED = 200;  // a sparse series (eval points) of at most this many points gets markers
const CHART = { W: 500, H: 260, L: 56, R: 14, T: 10, B: 36 };

const runsView = {
  runs: [],  // the rows of /api/runs
  curves: new Map(),  // run name -> {written, metrics: Map(key -> [[step, value], ...]), ...}
  colors: new Map(),  // run name -> colour, kept while the page is open
  chosen: new Set(),  // the metrics drawn
  picked: false,  // the user chose metrics: the defaults no longer apply
  hidden: new Set(),  // runs unticked
  filter: "",
  scales: new Map(),  // metric key -> "auto" | "linear" | "log"
  keys: "",  // the metric keys the selector was built for
};

const metricName = (key) => METRIC_NAMES.get(key) || key;

function colorOf(name) {
  if (!runsView.colors.has(name)) {
    runsView.colors.set(name, RUN_COLORS[runsView.colors.size % RUN_COLORS.length]);
  }
  return runsView.colors.get(name);
}

function extent(values) {
  // [min, max] without spreading a long array into arguments
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  return [lo, hi];
}

const matches = (name) => name.toLowerCase().includes(runsView.filter.toLowerCase());
const shown = (name) => matches(name) && !runsView.hidden.has(name);

function swatch(color) {
  const svg = svgElement("svg", { width: 18, height: 10, class: "runs-swatch" });
  svg.appendChild(svgElement("line", { x1: 1, y1: 5, x2: 17, y2: 5, stroke: color, "stroke-width": 2.5 }));
  return svg;
}

function percent(v, digits = 1) {
  return v === null || v === undefined ? "-" : (100 * v).toFixed(digits) + "%";
}

// -- ticks -----------------------------------------------------------------------------------
function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const m = raw / power;
  return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * power;
}

function linearTicks(lo, hi, count) {
  // ticks at 1, 2 or 5 times a power of ten, about `count` of them, and the range they span
  const step = niceStep(hi - lo, count);
  const first = Math.floor(lo / step + 1e-9) * step, last = Math.ceil(hi / step - 1e-9) * step;
  const ticks = [];
  // (at most 20: a span past float precision must not loop on)
  for (let i = 0; i < 20 && first + i * step <= last + step * 1e-9; i++) ticks.push(Number((first + i * step).toPrecision(12)));
  return { ticks, lo: first, hi: last };
}

function stepTicks(lo, hi) {
  // whole steps inside [lo, hi]
  const step = Math.max(1, niceStep(hi - lo, 6));
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi && ticks.length < 20; v += step) ticks.push(v);
  return ticks;
}

function logTicks(min, max) {
  // powers of ten around [min, max] (2 and 5 times them too over 2 decades or less)
  const lo = Math.floor(Math.log10(min)), hi = Math.max(Math.ceil(Math.log10(max)), lo + 1);
  const every = Math.ceil((hi - lo) / 6);
  const ticks = [];
  for (let k = lo; k <= hi; k += every) ticks.push(Number((10 ** k).toPrecision(12)));
  const minor = [];
  if (hi - lo <= 2) {
    for (let k = lo; k < hi; k++) minor.push(Number((2 * 10 ** k).toPrecision(12)), Number((5 * 10 ** k).toPrecision(12)));
  }
  return { ticks, minor, lo: 10 ** lo, hi: 10 ** hi };
}

function tickText(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-3) return Number(v.toPrecision(3)).toExponential().replace("e+", "e");
  return String(Number(v.toPrecision(6)));
}

function stepText(v) {
  if (v >= 1e6) return Number((v / 1e6).toPrecision(4)) + "M";
  if (v >= 1e4) return Number((v / 1e3).toPrecision(4)) + "k";
  return String(v);
}

// -- one chart -----------------------------------------------------------------------------
function drawChart(key) {
  const { W, H, L, R, T, B } = CHART;
  const box = document.createElement("div");
  box.className = "plot runs-chart";
  box.dataset.metric = key;
  const head = document.createElement("div");
  head.className = "runs-chart-head";
  const title = document.createElement("h3");
  title.textContent = metricName(key) === key ? key : metricName(key) + " (" + key + ")";
  head.appendChild(title);
  box.appendChild(head);

  // the shown runs that logged this key, their null (NaN, inf) points left out
  const series = [];
  for (const run of runsView.runs) {
    const curve = runsView.curves.get(run.name);
    const points = ((curve && curve.metrics.get(key)) || [])
      .filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
    if (points.length && matches(run.name)) series.push({ run: run.name, points, curve });
  }
  const drawn = series.filter((s) => !runsView.hidden.has(s.run));
  const ys = drawn.flatMap((s) => s.points.map((p) => p[1]));
  const [yMin, yMax] = extent(ys);
  const positive = ys.length > 0 && yMin > 0;
  const span = positive ? yMax / yMin : 0;
  const choice = runsView.scales.get(key) || "auto";
  const fraction = FRACTIONS.has(key);
  const log = positive && (choice === "log" || (choice === "auto" && span >= WIDE && !fraction));
  const valueText = (v, digits = 1) => (fraction && !log ? percent(v, digits) : tickText(v));
  box.dataset.scale = log ? "log" : "linear";

  const select = document.createElement("select");
  select.className = "runs-scale";
  select.title = "y axis";
  for (const [value, text] of [["auto", "auto (" + (log ? "log" : "linear") + ")"], ["linear", "linear"], ["log", "log"]]) {
    const option = document.createElement("option");
    option.value = value;
    option.textContent = text;
    select.appendChild(option);
  }
  select.value = choice;
  select.addEventListener("change", () => {
    runsView.scales.set(key, select.value);
    renderRuns();
  });
  head.appendChild(select);

  const svg = svgElement("svg", { width: W, height: H, class: "runs-svg" });
  box.appendChild(svg);
  const note = document.createElement("div");
  note.className = "runs-chart-note";
  box.appendChild(note);
  if (!drawn.length) {
    note.textContent = series.length ? "every run that logged it is hidden" : "no shown run logged it";
  } else {
    const xs = drawn.flatMap((s) => s.points.map((p) => p[0]));
    let [x0, x1] = extent(xs);
    if (x0 === x1) { x0 -= 1; x1 += 1; }  // one step: the point in the middle
    let y0 = yMin, y1 = yMax, yTicks, minor = [];
    if (log) {
      ({ ticks: yTicks, minor, lo: y0, hi: y1 } = logTicks(y0, y1));
    } else if (fraction) {
      ({ ticks: yTicks, lo: y0, hi: y1 } = linearTicks(Math.min(0, y0), Math.max(1, y1), 5));
    } else {
      if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
      ({ ticks: yTicks, lo: y0, hi: y1 } = linearTicks(y0, y1, 5));
    }
    const fy = log ? Math.log10 : (v) => v;
    const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const py = (y) => T + (1 - (fy(y) - fy(y0)) / (fy(y1) - fy(y0))) * (H - T - B);
    const axis = svgElement("g", { class: "runs-axis" });
    svg.appendChild(axis);
    for (const [ticks, major] of [[yTicks, true], [minor, false]]) {
      for (const v of ticks) {
        const y = py(v).toFixed(1);
        axis.appendChild(svgElement("line", { x1: L, y1: y, x2: W - R, y2: y, stroke: major ? "#e4e8ec" : "#f1f3f5" }));
        const label = svgElement("text", { x: L - 5, y: Number(y) + 3, "text-anchor": "end", class: major ? "runs-ytick" : "runs-ytick runs-minor" });
        label.textContent = valueText(v, 0);
        axis.appendChild(label);
      }
    }
    for (const v of stepTicks(x0, x1)) {
      const x = px(v).toFixed(1);
      axis.appendChild(svgElement("line", { x1: x, y1: H - B, x2: x, y2: H - B + 4, stroke: "#9aa5b1" }));
      const label = svgElement("text", { x, y: H - B + 15, "text-anchor": "middle", class: "runs-xtick" });
      label.textContent = stepText(v);
      axis.appendChild(label);
    }
    axis.appendChild(svgElement("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#9aa5b1" }));
    axis.appendChild(svgElement("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#9aa5b1" }));
    const caption = svgElement("text", { x: W - R, y: H - 4, "text-anchor": "end", class: "runs-caption" });
    caption.textContent = "step" + (log ? "   (log y)" : "");
    axis.appendChild(caption);
    for (const s of drawn) {
      const color = colorOf(s.run);
      const g = svgElement("g", { class: "runs-series" });
      g.dataset.run = s.run;
      if (s.points.length > 1) {
        const line = svgElement("polyline", {
          class: "runs-line", fill: "none", stroke: color, "stroke-width": 1.6,
          points: s.points.map((p) => px(p[0]).toFixed(1) + "," + py(p[1]).toFixed(1)).join(" "),
        });
        g.appendChild(line);
      }
      // markers: a lone point, or a sparse series (eval every N steps, a held-out match)
      const most = extent([...s.curve.metrics.values()].map((p) => p.length))[1];
      if (s.points.length <= 2 || (s.points.length <= MARKED && 2 * s.points.length <= most)) {
        for (const [step, value] of s.points) {
          const dot = svgElement("circle", {
            class: "runs-marker", cx: px(step).toFixed(1), cy: py(value).toFixed(1), r: 3.5,
            fill: color, stroke: "#fff", "stroke-width": 1,
          });
          const tip = svgElement("title", {});
          tip.textContent = s.run + ": step " + step + ", " + valueText(value);
          dot.appendChild(tip);
          g.appendChild(dot);
        }
      }
      svg.appendChild(g);
    }
    const notes = [];
    if (choice === "log" && !log) notes.push("log needs every value above 0: linear");
    if (drawn.some((s) => s.curve.thinned.includes(key))) notes.push("long series thinned to 1000 points");
    note.textContent = notes.join("; ");
  }

  const legend = document.createElement("div");
  legend.className = "runs-legend";
  for (const s of series) {
    const item = document.createElement("button");
    item.type = "button";
    item.className = "runs-entry" + (runsView.hidden.has(s.run) ? " runs-off" : "");
    item.dataset.run = s.run;
    item.title = runsView.hidden.has(s.run) ? "show this run" : "hide this run";
    item.append(swatch(colorOf(s.run)), document.createTextNode(s.run));
    item.addEventListener("click", () => setShown(s.run, runsView.hidden.has(s.run)));
    legend.appendChild(item);
  }
  box.appendChild(legend);
  return box;
}

function setShown(name, on) {
  if (on) runsView.hidden.delete(name);
  else runsView.hidden.add(name);
  renderRuns();
}

// -- the table, the metric selector, the charts ------------------------------------------------
function renderTable() {
  const rows = [];
  for (const run of runsView.runs) {
    const tr = document.createElement("tr");
    tr.dataset.run = run.name;
    if (!matches(run.name)) tr.className = "runs-filtered";
    const first = document.createElement("td");
    const label = document.createElement("label");
    label.className = "runs-name";
    const box = document.createElement("input");
    box.type = "checkbox";
    box.className = "runs-show";
    box.dataset.run = run.name;
    box.checked = !runsView.hidden.has(run.name);
    box.title = "draw this run";
    box.addEventListener("change", () => setShown(run.name, box.checked));
    label.append(box, swatch(colorOf(run.name)), document.createTextNode(run.name));  // a folder's name is data
    first.appendChild(label);
    tr.appendChild(first);
    const step = (run.step ?? "-") + (run.planned_steps ? "/" + run.planned_steps : "");
    const cells = [
      [run.status, run.status.split(" ")[0]], [step, "num"], [fmt(run.loss), "num"],
      [fmt(run.eval_loss), "num"], [percent(run.heldout_exact_match), "num"],
      [fmt(run.tokens_per_second, 0), "num"], [duration(run.eta_seconds), "num"],
    ];
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    rows.push(tr);
  }
  document.querySelector("#runs-table tbody").replaceChildren(...rows);
}

function metricKeys() {
  // every key any run logged, in the order the runs list them (the known ones first)
  const keys = [];
  const seen = new Set();
  for (const run of runsView.runs) {
    const curve = runsView.curves.get(run.name);
    for (const key of curve ? curve.metrics.keys() : []) {
      if (!seen.has(key)) { seen.add(key); keys.push(key); }
    }
  }
  return keys;
}

function renderSelector(keys) {
  if (!runsView.picked) runsView.chosen = new Set(DEFAULT_METRICS.filter((k) => keys.includes(k)));
  const box = $("runs-metrics");
  const signature = JSON.stringify(keys);
  if (signature !== runsView.keys) {  // rebuilt only when the keys change: a click is not lost
    runsView.keys = signature;
    box.replaceChildren(box.querySelector("legend"));
    for (const key of keys) {
      const label = document.createElement("label");
      label.className = "runs-metric";
      const check = document.createElement("input");
      check.type = "checkbox";
      check.value = key;
      check.addEventListener("change", () => {
        if (!runsView.picked) runsView.picked = true;
        if (check.checked) runsView.chosen.add(key);
        else runsView.chosen.delete(key);
        renderRuns();
      });
      label.append(check, document.createTextNode(metricName(key)));
      if (metricName(key) !== key) label.title = key;
      box.appendChild(label);
    }
  }
  for (const check of box.querySelectorAll("input[type=checkbox]")) check.checked = runsView.chosen.has(check.value);
}

function renderRuns() {
  renderTable();
  const keys = metricKeys();
  renderSelector(keys);
  $("plots").replaceChildren(...keys.filter((k) => runsView.chosen.has(k)).map(drawChart));
  const notes = [];
  if (!runsView.runs.length) notes.push("no run directories in the folder");
  for (const run of runsView.runs) {
    const curve = runsView.curves.get(run.name);
    if (curve && curve.error) notes.push(run.name + ": " + curve.error);
    if (curve && curve.leftOut) notes.push(run.name + ": " + curve.leftOut + " more metric keys not served");
  }
  $("runs-note").textContent = notes.join("\n");
}

// -- loading -----------------------------------------------------------------------------------
const runPath = (name) => "/api/runs/" + encodeURIComponent(name).replace(/\./g, "%2E");  // "." stays a name

async function loadCurves(run) {
  const cached = runsView.curves.get(run.name);
  if (cached && cached.written === run.last_written) return;  // nothing written since
  const response = await fetch(runPath(run.name), { headers: headers() });
  const body = await response.json();
  const metrics = new Map();
  if (response.ok && body.metrics) for (const [key, points] of Object.entries(body.metrics)) metrics.set(key, points);
  runsView.curves.set(run.name, {
    written: run.last_written, metrics, thinned: body.thinned || [], leftOut: body.keys_left_out || 0,
    error: response.ok ? body.error : body.error && body.error.message,
  });
}

let runsTimer = null, runsLoading = false;

async function refreshRuns() {
  clearTimeout(runsTimer);
  if (runsLoading) return;  // the load under way schedules the next
  runsLoading = true;
  let running = false;
  try {
    const response = await fetch("/api/runs", { headers: headers() });
    const data = await response.json();
    if (!response.ok) {
      $("runs-note").textContent = data.error.message;
      return;
    }
    for (const run of data.runs) await loadCurves(run);
    const names = new Set(data.runs.map((r) => r.name));
    for (const name of [...runsView.curves.keys()]) if (!names.has(name)) runsView.curves.delete(name);
    runsView.runs = data.runs;
    renderRuns();
    document.body.dataset.runsLoaded = String(Date.now());
    running = data.runs.some((r) => r.status === "running");
  } catch (err) {  // the server restarting, say: tried again while a run was running
    $("runs-note").textContent = "could not read the runs: " + err.message;
    running = runsView.runs.some((r) => r.status === "running");
  } finally {
    runsLoading = false;
    if (running) runsTimer = setTimeout(refreshRuns, 5000);
  }
}

$("runs-filter").addEventListener("input", () => {
  runsView.filter = $("runs-filter").value;
  renderRuns();
});

(tabHooks.runs ||= []).push(refreshRuns);
globalThis.refreshRuns = refreshRuns;  // another tab may ask for a fresh list (a run it started)
})();
