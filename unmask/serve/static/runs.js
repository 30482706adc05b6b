// The runs of --runs DIR (common.js holds the shared helpers): a table of the runs, and one
// chart per chosen metric of metrics.jsonl (GET /api/runs/NAME serves every numeric key),
// every shown run overlaid in its own colour, with a legend. What the user chose (the
// metrics, the runs shown, the filter, each chart's scale) lives in `runsView` and
// survives the refresh every 5 s while a run is running. Run names and metric keys are
// data: they go in as text (textContent, setAttribute), never as HTML. All in one function
// scope: the page's scripts share one global scope, and only refreshRuns is put in it.
"use strict";

(() => {

// twelve colours told apart (each pair at least 34 apart in CIELAB): a 13th run reuses the first
const RUN_COLORS = ["#2563eb", "#f97316", "#15803d", "#be123c", "#7c3aed", "#06b6d4",
  "#92400e", "#f472b6", "#6b7280", "#a3e635", "#111827", "#facc15"];
// shown until the user picks metrics (those a run logged)
const DEFAULT_METRICS = ["loss", "eval_loss", "heldout_exact_match"];
// the x axes: a run's step, its wall time (elapsed_seconds) or the tokens it has seen
const X_AXES = {
  step: { key: null, caption: "step" },
  wall: { key: "elapsed_seconds", caption: "wall time" },
  tokens: { key: "tokens_seen", caption: "tokens seen" },
};
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
  labels: new Map(),  // metric key -> its name (the server's one table, runs_view.METRIC_LABELS)
  xaxis: "step",  // a key of X_AXES
  smoothing: 0,  // the EMA weight (0: raw values)
  zoom: null,  // [lo, hi] of the x axis shown, or null: everything
};

const metricName = (key) => runsView.labels.get(key) || key;

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

// -- smoothing, the x axis, the tooltip, export ---------------------------------------------
function smoothed(values, weight) {
  // an exponential moving average, its start debiased (TensorBoard's smoothing): the first
  // value is not pulled towards 0
  let last = 0, count = 0;
  return values.map((v) => {
    last = last * weight + (1 - weight) * v;
    count += 1;
    return weight > 0 ? last / (1 - Math.pow(weight, count)) : v;
  });
}

function xOf(curve) {
  // step -> the chosen x axis' value for one run (null: it did not log it), interpolated
  // between the steps that logged it
  const key = X_AXES[runsView.xaxis].key;
  if (key === null) return (step) => step;
  const known = ((curve && curve.metrics.get(key)) || []).filter((p) => Number.isFinite(p[1]));
  return (step) => {
    if (!known.length || step < known[0][0] || step > known[known.length - 1][0]) return null;
    let lo = 0, hi = known.length - 1;
    while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (known[mid][0] <= step) lo = mid; else hi = mid; }
    const [s0, v0] = known[lo], [s1, v1] = known[hi];
    if (s0 === step) return v0;
    if (s1 === step) return v1;
    return v0 + ((step - s0) / (s1 - s0)) * (v1 - v0);
  };
}

function xText(v) {
  if (runsView.xaxis === "wall") return duration(v);
  return stepText(Math.round(v));
}

function seriesOf(key) {
  // the runs that logged this key and match the filter: [{run, curve, points: [[x, value,
  // step], ...]}], null (NaN, inf) values and points without an x left out
  const out = [];
  for (const run of runsView.runs) {
    const curve = runsView.curves.get(run.name);
    const x = xOf(curve);
    const points = [];
    for (const [step, value] of (curve && curve.metrics.get(key)) || []) {
      if (!Number.isFinite(step) || !Number.isFinite(value)) continue;
      const at = x(step);
      if (at !== null && Number.isFinite(at)) points.push([at, value, step]);
    }
    if (matches(run.name) && points.length) out.push({ run: run.name, points, curve });
  }
  return out;
}

function csvText(key) {
  // every shown run's points of the chart as drawn (zoom kept): run, step, x, value
  // (and the smoothed value when smoothing)
  const axis = runsView.xaxis;
  const head = ["run", "step"];
  if (axis !== "step") head.push(X_AXES[axis].key);
  head.push(key);
  if (runsView.smoothing > 0) head.push(key + "_smoothed");
  const quote = (text) => (/[",\n]/.test(text) ? '"' + text.replace(/"/g, '""') + '"' : text);
  const lines = [head.join(",")];
  for (const s of seriesOf(key).filter((s) => !runsView.hidden.has(s.run))) {
    const smooth = smoothed(s.points.map((p) => p[1]), runsView.smoothing);
    s.points.forEach(([x, value, step], i) => {
      if (runsView.zoom && (x < runsView.zoom[0] || x > runsView.zoom[1])) return;
      const row = [quote(s.run), String(step)];
      if (axis !== "step") row.push(String(x));
      row.push(String(value));
      if (runsView.smoothing > 0) row.push(String(Number(smooth[i].toPrecision(10))));
      lines.push(row.join(","));
    });
  }
  return lines.join("\n") + "\n";
}

function download(name, blob) {
  const url = URL.createObjectURL(blob);
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  document.body.appendChild(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

const fileName = (key, ext) => "unmask-" + key.replace(/[^A-Za-z0-9_.-]/g, "_") + "." + ext;

function exportPng(box, key) {
  // the chart's SVG (fonts and colours inlined, the title in a band above it) drawn on a
  // canvas at 2x
  const TITLE = 24;
  const chart = box.querySelector("svg.runs-svg").cloneNode(true);
  for (const text of chart.querySelectorAll("text")) {
    text.setAttribute("font-family", "sans-serif");
    text.setAttribute("font-size", "10");
    text.setAttribute("fill", "#5a6570");
  }
  for (const hover of chart.querySelectorAll(".runs-guide, .runs-brush")) hover.remove();
  const svg = svgElement("svg", { xmlns: "http://www.w3.org/2000/svg", width: CHART.W, height: CHART.H + TITLE });
  svg.appendChild(svgElement("rect", { x: 0, y: 0, width: CHART.W, height: CHART.H + TITLE, fill: "#fff" }));
  const title = svgElement("text", { x: CHART.L, y: 16, "font-family": "sans-serif", "font-size": "13", fill: "#1d232a" });
  title.textContent = metricName(key);
  svg.appendChild(title);
  const body = svgElement("g", { transform: `translate(0,${TITLE})` });
  body.append(...chart.childNodes);
  svg.appendChild(body);
  const source = new Blob([new XMLSerializer().serializeToString(svg)], { type: "image/svg+xml" });
  const url = URL.createObjectURL(source);
  const image = new Image();
  image.onload = () => {
    const canvas = document.createElement("canvas");
    canvas.width = 2 * CHART.W;
    canvas.height = 2 * (CHART.H + TITLE);
    const context = canvas.getContext("2d");
    context.scale(2, 2);
    context.drawImage(image, 0, 0);
    URL.revokeObjectURL(url);
    canvas.toBlob((png) => download(fileName(key, "png"), png), "image/png");
  };
  image.src = url;
}

function nearest(points, x) {
  // the index of the point whose x is nearest (points sorted by x)
  let lo = 0, hi = points.length - 1;
  while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (points[mid][0] <= x) lo = mid; else hi = mid; }
  return Math.abs(points[hi][0] - x) < Math.abs(points[lo][0] - x) ? hi : lo;
}

function showTip(event, lines) {
  const tip = $("runs-tip");
  tip.replaceChildren(...lines.map(([color, text]) => {
    const row = document.createElement("div");
    if (color) row.appendChild(swatch(color));
    row.appendChild(document.createTextNode(text));
    return row;
  }));
  tip.hidden = false;
  tip.style.left = (event.pageX + 14) + "px";
  tip.style.top = (event.pageY + 10) + "px";
}

function hideTip() { $("runs-tip").hidden = true; }

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

  const series = seriesOf(key);
  const zoom = runsView.zoom;
  const inZoom = (p) => !zoom || (p[0] >= zoom[0] && p[0] <= zoom[1]);
  const weight = runsView.smoothing;
  const drawn = series.filter((s) => !runsView.hidden.has(s.run)).map((s) => {
    const smooth = weight > 0 ? smoothed(s.points.map((p) => p[1]), weight) : null;
    const keep = s.points.map(inZoom);
    return { ...s, points: s.points.filter((p, i) => keep[i]),
             smooth: smooth && smooth.filter((v, i) => keep[i]) };
  }).filter((s) => s.points.length);
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
  const tools = document.createElement("span");
  tools.className = "runs-tools";
  for (const [cls, text, hint, act] of [
    ["runs-csv", "CSV", "the points drawn, as CSV", () => download(fileName(key, "csv"), new Blob([csvText(key)], { type: "text/csv" }))],
    ["runs-png", "PNG", "this chart as a PNG image", () => exportPng(box, key)],
  ]) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = cls;
    button.textContent = text;
    button.title = hint;
    button.addEventListener("click", act);
    tools.appendChild(button);
  }
  tools.appendChild(select);
  head.appendChild(tools);

  const svg = svgElement("svg", { width: W, height: H, class: "runs-svg" });
  box.appendChild(svg);
  const note = document.createElement("div");
  note.className = "runs-chart-note";
  box.appendChild(note);
  if (!drawn.length) {
    const axis = X_AXES[runsView.xaxis];
    note.textContent = zoom && series.some((s) => !runsView.hidden.has(s.run)) ? "no point in the zoomed range"
      : series.length ? "every run that logged it is hidden"
      : axis.key ? "no shown run logged it with " + metricName(axis.key) : "no shown run logged it";
  } else {
    const xs = drawn.flatMap((s) => s.points.map((p) => p[0]));
    let [x0, x1] = zoom ? zoom : extent(xs);
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
    const xTicks = runsView.xaxis === "step" ? stepTicks(x0, x1) : linearTicks(x0, x1, 5).ticks.filter((v) => v >= x0 && v <= x1);
    for (const v of xTicks) {
      const x = px(v).toFixed(1);
      axis.appendChild(svgElement("line", { x1: x, y1: H - B, x2: x, y2: H - B + 4, stroke: "#9aa5b1" }));
      const label = svgElement("text", { x, y: H - B + 15, "text-anchor": "middle", class: "runs-xtick" });
      label.textContent = xText(v);
      axis.appendChild(label);
    }
    axis.appendChild(svgElement("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#9aa5b1" }));
    axis.appendChild(svgElement("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#9aa5b1" }));
    const caption = svgElement("text", { x: W - R, y: H - 4, "text-anchor": "end", class: "runs-caption" });
    caption.textContent = X_AXES[runsView.xaxis].caption + (log ? "   (log y)" : "");
    axis.appendChild(caption);
    const clip = "runs-clip-" + key.replace(/[^A-Za-z0-9_-]/g, "_");
    const defs = svgElement("defs", {});
    const clipPath = svgElement("clipPath", { id: clip });
    clipPath.appendChild(svgElement("rect", { x: L - 5, y: T - 5, width: W - L - R + 10, height: H - T - B + 10 }));
    defs.appendChild(clipPath);
    svg.appendChild(defs);
    const line = (points, values) => points.map((p, i) => px(p[0]).toFixed(1) + "," + py(values ? values[i] : p[1]).toFixed(1)).join(" ");
    for (const s of drawn) {
      const color = colorOf(s.run);
      const g = svgElement("g", { class: "runs-series", "clip-path": `url(#${clip})` });
      g.dataset.run = s.run;
      if (s.points.length > 1) {
        // smoothing: the raw line stays, faint, under the smoothed one
        g.appendChild(svgElement("polyline", {
          class: s.smooth ? "runs-line runs-raw" : "runs-line", fill: "none", stroke: color,
          "stroke-width": s.smooth ? 1.2 : 1.6, "stroke-opacity": s.smooth ? 0.25 : 1, points: line(s.points),
        }));
        if (s.smooth) {
          const smooth = svgElement("polyline", {
            class: "runs-smooth", fill: "none", stroke: color, "stroke-width": 1.8, points: line(s.points, s.smooth),
          });
          smooth.dataset.values = JSON.stringify(s.smooth.map((v) => Number(v.toPrecision(8))));
          g.appendChild(smooth);
        }
      }
      // markers: a lone point, or a sparse series (eval every N steps, a held-out match)
      const most = extent([...s.curve.metrics.values()].map((p) => p.length))[1];
      if (s.points.length <= 2 || (s.points.length <= MARKED && 2 * s.points.length <= most)) {
        for (const [x, value, step] of s.points) {
          const dot = svgElement("circle", {
            class: "runs-marker", cx: px(x).toFixed(1), cy: py(value).toFixed(1), r: 3.5,
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
    // hover: a guide line and each run's nearest point (run, step, value); drag: zoom
    const guide = svgElement("line", { class: "runs-guide", x1: 0, x2: 0, y1: T, y2: H - B, stroke: "#9aa5b1", "stroke-dasharray": "3 3", visibility: "hidden" });
    const brush = svgElement("rect", { class: "runs-brush", x: 0, y: T, width: 0, height: H - T - B, fill: "#2563eb", "fill-opacity": 0.12, visibility: "hidden" });
    svg.append(guide, brush);
    const dataX = (event) => {
      const at = event.clientX - svg.getBoundingClientRect().left;
      const clamped = Math.min(W - R, Math.max(L, at));
      return [clamped, x0 + ((clamped - L) / (W - L - R)) * (x1 - x0)];
    };
    let dragFrom = null;
    svg.addEventListener("mousedown", (event) => {
      dragFrom = dataX(event)[0];
      event.preventDefault();
    });
    svg.addEventListener("mousemove", (event) => {
      const [at, x] = dataX(event);
      if (dragFrom !== null) {
        brush.setAttribute("x", Math.min(dragFrom, at));
        brush.setAttribute("width", Math.abs(at - dragFrom));
        brush.setAttribute("visibility", "visible");
      }
      guide.setAttribute("x1", at);
      guide.setAttribute("x2", at);
      guide.setAttribute("visibility", "visible");
      const lines = [];
      for (const s of drawn) {
        const i = nearest(s.points, x);
        const [px0, value, step] = s.points[i];
        let text = s.run + ": step " + step;
        if (runsView.xaxis !== "step") text += " (" + xText(px0) + ")";
        text += ", " + valueText(value, 2);
        if (s.smooth) text += " (smoothed " + valueText(s.smooth[i], 2) + ")";
        lines.push([colorOf(s.run), text]);
      }
      showTip(event, [[null, metricName(key)], ...lines]);
    });
    svg.addEventListener("mouseleave", () => {
      guide.setAttribute("visibility", "hidden");
      hideTip();
    });
    svg.addEventListener("mouseup", (event) => {
      if (dragFrom === null) return;
      const to = dataX(event)[0], from = dragFrom;
      dragFrom = null;
      brush.setAttribute("visibility", "hidden");
      if (Math.abs(to - from) < 5) return;  // a click, not a drag
      const value = (at) => x0 + ((at - L) / (W - L - R)) * (x1 - x0);
      setZoom([value(Math.min(from, to)), value(Math.max(from, to))]);
    });
    svg.addEventListener("dblclick", () => setZoom(null));
    const notes = [];
    if (choice === "log" && !log) notes.push("log needs every value above 0: linear");
    if (drawn.some((s) => s.curve.thinned.includes(key))) notes.push("long series thinned to 1000 points");
    const missing = series.filter((s) => !runsView.hidden.has(s.run)).length - drawn.length;
    if (zoom && missing > 0) notes.push(missing + " run(s) outside the zoomed range");
    note.textContent = notes.join("; ");
  }
  box.dataset.xaxis = runsView.xaxis;

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

function setZoom(range) {
  runsView.zoom = range;
  $("runs-zoom-reset").disabled = range === null;
  document.body.dataset.runsZoom = range === null ? "" : range.map((v) => Number(v.toPrecision(6))).join(",");
  hideTip();
  renderRuns();
}

function setShown(name, on) {
  if (on) runsView.hidden.delete(name);
  else runsView.hidden.add(name);
  renderRuns();
}

// -- the table, the metric selector, the charts ------------------------------------------------
// the run statuses of the runs API (one rule with `unmask runs`), as the table words them
const STATUS_HINTS = {
  running: "training: its process is alive (or it wrote within the last minutes)",
  crashed: "it ended without a checkpoint of its last steps, or its process died",
  stopped: "stopped on request after saving a checkpoint: resume it to go on",
  finished: "ran all its steps and saved its final model",
};

function statusOf(run) {
  // [word, step it stopped at or null]: "stopped at step 29" -> ["stopped", 29]
  const status = String(run.status || "unknown");
  const stopped = /^stopped(?: at step (\d+))?/.exec(status);
  if (stopped) return ["stopped", stopped[1] === undefined ? null : Number(stopped[1])];
  return [status.split(" ")[0], null];
}

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
    // "stopped at step N": status stopped, its step N (the checkpoint's: the steps after the
    // last logged one ran too), as "step N/M" says it
    const [word, stoppedAt] = statusOf(run);
    const last = stoppedAt === null ? run.step : Math.max(run.step ?? 0, stoppedAt);
    const step = (last ?? "-") + (run.planned_steps ? "/" + run.planned_steps : "");
    const cells = [
      [word, "runs-status " + word], [step, "num"], [fmt(run.loss), "num"],
      [fmt(run.eval_loss), "num"], [percent(run.heldout_exact_match), "num"],
      [fmt(run.tokens_per_second, 0), "num"], [duration(run.eta_seconds), "num"],
    ];
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    tr.children[1].title = STATUS_HINTS[word] || run.status;
    tr.dataset.status = word;
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
  for (const [key, label] of Object.entries((response.ok && body.labels) || {})) runsView.labels.set(key, label);
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
$("runs-x").addEventListener("change", () => {
  runsView.xaxis = $("runs-x").value;
  setZoom(null);  // a range of steps is not one of seconds
});
$("runs-smooth").addEventListener("input", () => {
  runsView.smoothing = Number($("runs-smooth").value);
  $("runs-smooth-value").textContent = $("runs-smooth").value;
  renderRuns();
});
$("runs-zoom-reset").addEventListener("click", () => setZoom(null));

(tabHooks.runs ||= []).push(refreshRuns);
globalThis.refreshRuns = refreshRuns;  // another tab may ask for a fresh list (a run it started)
globalThis.runsCsv = csvText;  // the CSV of a chart (what its CSV button downloads)
})();
