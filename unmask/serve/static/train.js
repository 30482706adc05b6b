// The Train tab (`unmask serve --allow-train`; docs/serving.md, Training from the page):
// pick a config (GET /api/train lists them, /api/train/configs/NAME gives one's text) or
// upload a YAML file, edit it, name the run and queue it (POST /api/train); the queue
// polled every second, the selected job's log read on from where it was
// (/api/train/ID/log?offset=N) and its loss curve from the runs view's /api/runs/NAME;
// Stop (POST /api/train/ID/stop, one button, the selected job's): SIGTERM, the run saves a
// checkpoint. A picked config is sent by its name (the job lists it so), an edited or
// uploaded one as text with what it came from. Everything from the server goes in as text.
"use strict";

// picked: the config picked and its text as served (sent by name while unedited);
// uploaded: the file name the editor's text came from
const train = { selected: null, offset: 0, jobs: [], curveAt: 0, busy: false,
                picked: null, uploaded: null };
const TRAIN_LOG_CHARS = 200000;  // the log shown keeps its last this many characters

function trainNote(text, error = false) {
  $("train-note").textContent = text || "";
  $("train-note").classList.toggle("train-error", error);
}

async function trainFetch(path, options = {}) {
  const response = await fetch(path, { headers: headers(), ...options });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const message = (data.error && data.error.message) || response.status + " " + response.statusText;
    throw new Error(message);
  }
  return data;
}

async function pickConfig() {
  const name = $("train-pick").value;
  if (!name) return;
  try {
    const data = await trainFetch("/api/train/configs/" + encodeURIComponent(name));
    $("train-text").value = data.text;
    train.picked = { name, text: data.text };
    train.uploaded = null;
    $("train-file").value = "";
    trainNote("");
  } catch (err) {
    trainNote(err.message, true);
  }
}

function uploadConfig() {
  const file = $("train-file").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => {
    $("train-text").value = reader.result;
    $("train-pick").value = "";
    train.picked = null;
    train.uploaded = file.name;
    if (!$("train-name").value) $("train-name").value = file.name.replace(/\.ya?ml$/i, "");
    trainNote("");
  };
  reader.onerror = () => trainNote("could not read " + file.name, true);
  reader.readAsText(file);
}

async function startRun() {
  const text = $("train-text").value;
  const body = {
    name: $("train-name").value.trim(),
    overrides: $("train-overrides").value.split(/\s+/).filter((s) => s),
  };
  if (!text.trim()) return trainNote("pick a config or upload a YAML file first", true);
  if (!body.name) return trainNote("name the run (its folder in the runs folder)", true);
  if (train.picked && train.picked.text === text) {
    body.config_name = train.picked.name;  // listed by its own name
  } else {
    body.config_text = text;
    if (train.picked) body.source = train.picked.name + " (edited)";
    else if (train.uploaded) body.source = train.uploaded + " (uploaded)";
  }
  try {
    const job = await trainFetch("/api/train", { method: "POST", body: JSON.stringify(body) });
    trainNote("queued " + job.name + " (job " + job.id + ")");
    selectJob(job.id);
    await refreshTrain();
  } catch (err) {
    trainNote(err.message, true);
  }
}

async function stopJob(id) {
  try {
    const job = await trainFetch("/api/train/" + encodeURIComponent(id) + "/stop", { method: "POST" });
    trainNote(job.state === "cancelled" ? "cancelled " + job.name : "stopping " + job.name + " (it saves a checkpoint first)");
    await refreshTrain();
  } catch (err) {
    trainNote(err.message, true);
  }
}

function selectJob(id) {
  if (train.selected === id) return;
  train.selected = id;
  train.offset = 0;
  train.curveAt = 0;
  $("train-log").textContent = "";
  $("train-curve").replaceChildren();
}

function jobRow(job) {
  const tr = document.createElement("tr");
  tr.dataset.job = job.id;
  tr.classList.toggle("train-selected", job.id === train.selected);
  const state = job.stopping ? "stopping" : job.state;
  const cells = [[job.id, "num"], [job.name, ""], [job.source, ""], [state, "train-state " + job.state],
                 [job.exit_code === null ? "-" : String(job.exit_code), "num"]];
  for (const [text, cls] of cells) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    tr.appendChild(td);
  }
  tr.addEventListener("click", () => { selectJob(job.id); drawJobs(); });
  return tr;
}

function drawJobs() {
  $("train-jobs").querySelector("tbody").replaceChildren(...train.jobs.map(jobRow));
  const job = train.jobs.find((j) => j.id === train.selected);
  const view = $("train-view");
  view.hidden = !job;
  if (!job) return;
  view.dataset.job = job.id;
  view.dataset.state = job.state;
  $("train-selected").textContent = job.name + " (job " + job.id + "): " + (job.stopping ? "stopping" : job.state) +
    (job.exit_code === null ? "" : ", exit code " + job.exit_code);
  $("train-stop").disabled = !(job.state === "queued" || (job.state === "running" && !job.stopping));
  $("train-stop").textContent = job.state === "queued" ? "Cancel" : "Stop";
}

function showLog(text) {
  // a progress bar's carriage returns: each line shows what was written after its last one
  const pre = $("train-log");
  const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  let all = pre.textContent + text;
  if (all.length > TRAIN_LOG_CHARS) all = all.slice(all.length - TRAIN_LOG_CHARS);
  pre.textContent = all.split("\n").map((line) => line.slice(line.lastIndexOf("\r") + 1)).join("\n");
  if (atEnd) pre.scrollTop = pre.scrollHeight;
}

async function readLog(job) {
  for (let reads = 0; reads < 8; reads++) {  // a long log arrives in chunks
    const data = await trainFetch("/api/train/" + encodeURIComponent(job.id) + "/log?offset=" + train.offset);
    if (train.selected !== job.id) return;
    if (data.text) showLog(data.text);
    train.offset = data.offset;
    if (!data.more) break;
  }
}

function drawTrainCurve(name, data) {
  // the run's loss (blue) and eval loss (orange) by step
  const metrics = data.metrics || data;
  const finite = (s) => (s || []).filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
  const series = [["loss", "#2563eb", finite(metrics.loss)], ["eval_loss", "#ea580c", finite(metrics.eval_loss)]];
  const all = series.flatMap((s) => s[2]);
  const W = 420, H = 190, L = 46, B = 30, T = 8, R = 10;
  const box = $("train-curve");
  const title = document.createElement("h3");
  title.textContent = name + ": loss by step";
  const svg = svgElement("svg", { width: W, height: H });
  if (!all.length) {
    box.replaceChildren(title, svg, document.createTextNode("no steps logged yet"));
    return;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let lo = Math.min(...ys), hi = Math.max(...ys);
  if (hi - lo < 1e-9) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
  const { ticks: yTicks, lo: y0, hi: y1 } = linearTicks(lo, hi, 4);
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  // ticks at 1, 2 or 5 times a power of ten (common.js), the axes spanning them
  for (const v of yTicks) {
    const y = py(v).toFixed(1);
    svg.appendChild(svgElement("line", { x1: L, y1: y, x2: W - R, y2: y, stroke: "#eef0f3" }));
    const label = svgElement("text", { x: L - 4, y: Number(y) + 3, "text-anchor": "end", class: "train-ytick" });
    label.textContent = tickText(v);
    svg.appendChild(label);
  }
  for (const v of stepTicks(x0, x1)) {
    const x = px(v).toFixed(1);
    svg.appendChild(svgElement("line", { x1: x, y1: H - B, x2: x, y2: H - B + 4, stroke: "#9aa5b1" }));
    const label = svgElement("text", { x, y: H - B + 14, "text-anchor": "middle", class: "train-xtick" });
    label.textContent = stepText(v);
    svg.appendChild(label);
  }
  svg.appendChild(svgElement("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#9aa5b1" }));
  svg.appendChild(svgElement("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#9aa5b1" }));
  const caption = svgElement("text", { x: W - R, y: H - 2, "text-anchor": "end" });
  caption.textContent = "step";
  svg.appendChild(caption);
  for (const [key, color, points] of series) {
    if (points.length === 1) {
      svg.appendChild(svgElement("circle", { class: key, cx: px(points[0][0]), cy: py(points[0][1]), r: 3, fill: color }));
    } else if (points.length) {
      svg.appendChild(svgElement("polyline", {
        class: key, fill: "none", stroke: color, "stroke-width": 1.6,
        points: points.map((p) => px(p[0]).toFixed(1) + "," + py(p[1]).toFixed(1)).join(" "),
      }));
    }
  }
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const [key, label] of [["loss", "loss"], ["eval_loss", "eval loss"]]) {
    const item = document.createElement("span");
    item.className = key;
    item.textContent = "\u2014 " + label;
    legend.appendChild(item);
  }
  box.replaceChildren(title, svg, legend);
}

async function readCurve(job) {
  // asked for once the run has logged a step (before, the runs view has no such run)
  if (Date.now() - train.curveAt < 3000 || job.state === "queued" || !job.has_metrics) return;
  if (job.ended && train.curveAt > job.ended * 1000) return;  // drawn after its last step
  train.curveAt = Date.now();
  const response = await fetch("/api/runs/" + encodeURIComponent(job.name), { headers: headers() });
  if (!response.ok || train.selected !== job.id) return;  // no metrics yet: not a run yet
  drawTrainCurve(job.name, await response.json());
}

async function refreshTrain() {
  if (train.busy) return;
  train.busy = true;
  try {
    const data = await trainFetch("/api/train");
    const pick = $("train-pick");
    const names = ["", ...data.configs];
    if (pick.options.length !== names.length || names.some((n, i) => pick.options[i].value !== n)) {
      const chosen = pick.value;
      pick.replaceChildren(...names.map((n) => {
        const option = document.createElement("option");
        option.value = n;
        option.textContent = n || "(pick one)";
        return option;
      }));
      pick.value = names.includes(chosen) ? chosen : "";
    }
    train.jobs = data.jobs;
    if (train.selected === null && data.jobs.length) {
      const running = data.jobs.find((j) => j.state === "running");
      selectJob((running || data.jobs[data.jobs.length - 1]).id);
    }
    drawJobs();
    const job = data.jobs.find((j) => j.id === train.selected);
    if (job) {
      await readLog(job);
      await readCurve(job);
    }
    document.body.dataset.trainLoaded = String(Date.now());
  } catch (err) {
    trainNote(err.message, true);
  } finally {
    train.busy = false;
  }
}

$("train-pick").addEventListener("change", pickConfig);
$("train-file").addEventListener("change", uploadConfig);
$("train-start").addEventListener("click", startRun);
$("train-stop").addEventListener("click", () => { if (train.selected !== null) stopJob(train.selected); });
(tabHooks.train ||= []).push(refreshTrain);
setInterval(() => { if ($("train").classList.contains("on")) refreshTrain(); }, 1000);  // while shown
infoHooks.push((info) => {
  $("tab-train").hidden = !info.train;
  if (location.hash === "#train" && info.train) showTab("train");
});
