// The runs of --runs DIR (common.js holds the shared helpers).
"use strict";

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

(tabHooks.runs ||= []).push(refreshRuns);
