// The playground (common.js holds the shared helpers). What it offers comes from the loaded
// model (GET /api/info's `playground`, serve/presets.py): the presets the model takes, the
// decoders that apply, the options the chosen decoder accepts (the others hidden, never
// sent) and its first row. A masked model's canvas shows masks, commits and edits (a
// committed token replaced: joint_threshold); a uniform-canvas model's (DiffusionGemma) is
// tokens from the first step, renoised until they hold: no masks, nothing "edited".
"use strict";

// below this probability a committed token is marked (the legend's "low confidence")
const LOW = 0.5;
let optionKinds = {};  // name -> {kind, group}
let optionLabels = new Map();  // name -> its <label> (moved between the rows, hidden)
let playground = { decoder: "masked", decoders: [], accepted: {}, top_row: {}, presets: [],
                   uniform_canvas: false };

const LEGENDS = {
  masked: [["prompt", "prompt"], ["mask", MASK + " mask"], ["tok", "token"],
           ["tok new", "new this step"], ["tok edited", "edited (replaced after commit)"],
           ["tok low", "committed at low confidence"], ["tok eos", "\u00b7 end of text"],
           ["hint", "hover a token or a mask: its step, the proposal and its probability; an edit: its step and the token it replaced"]],
  uniform: [["prompt", "prompt"], ["tok", "canvas token"], ["tok new", "renoised this step"],
            ["tok eos", "\u00b7 end of text"],
            ["hint", "the canvas starts as random tokens, renoised every step until it holds; hover a token: the step it last changed"]],
};

function optionLabel(option) {
  const label = document.createElement("label");
  label.appendChild(document.createTextNode(option.name + " "));
  label.title = option.doc;
  label.dataset.optionLabel = option.name;
  let input;
  if (option.kind === "choice" || option.kind === "bool") {
    input = document.createElement("select");
    let values = option.kind === "bool" ? ["true", "false"] : option.choices;
    if (option.name === "decoder" && playground.decoders.length) values = playground.decoders;
    for (const value of ["", ...values]) {
      const item = document.createElement("option");
      item.value = value;
      item.textContent = value === "" ? `(${option.name === "decoder" ? playground.decoder : option.value})` : value;
      input.appendChild(item);
    }
  } else {
    input = document.createElement("input");
    input.type = "number";
    input.className = "num";
    if (option.kind === "float") input.step = "any";
    if (option.name === "max_tokens" || option.kind === "int") input.min = "1";
    input.placeholder = option.value === null ? "default" : String(option.value);
  }
  input.id = "opt-" + option.name;
  input.dataset.option = option.name;
  label.appendChild(input);
  return label;
}

function chosenDecoder() {
  const select = $("opt-decoder");
  return (select && select.value) || playground.decoder;
}

function placeOptions() {
  // the chosen decoder's first row on top, its other options under "every option", the
  // options it refuses hidden and emptied (a request never sends one)
  const decoder = chosenDecoder();
  const accepted = new Set(playground.accepted[decoder] || optionLabels.keys());
  const top = (playground.top_row[decoder] || []).filter((name) => optionLabels.has(name));
  $("top-options").replaceChildren(...top.map((name) => optionLabels.get(name)));
  for (const [name, label] of optionLabels) {
    if (!top.includes(name)) $("options").appendChild(label);
    label.hidden = !accepted.has(name);
    if (label.hidden) label.querySelector("[data-option]").value = "";
  }
  $("play").dataset.decoder = decoder;
}

function drawLegend() {
  const kind = playground.uniform_canvas ? "uniform" : "masked";
  $("play-legend").replaceChildren(...LEGENDS[kind].map(([cls, text]) => {
    const span = document.createElement("span");
    span.className = cls;
    span.textContent = text;
    return span;
  }));
  $("play-legend").dataset.kind = kind;
}

function buildOptions(info) {
  if (info.playground) playground = info.playground;
  $("options").textContent = "";
  optionKinds = {};
  optionLabels = new Map();
  for (const option of info.sampling_options || []) {
    optionKinds[option.name] = option;
    optionLabels.set(option.name, optionLabel(option));
  }
  $("preset").replaceChildren(...playground.presets.map((preset) => {
    const item = document.createElement("option");
    item.value = preset.name;
    item.textContent = preset.label;
    return item;
  }));
  const decoder = $("opt-decoder");
  if (decoder) decoder.addEventListener("change", placeOptions);
  placeOptions();
  drawLegend();
}

infoHooks.push(buildOptions);
let modelNotices = [];  // /api/info's: warnings about the model (a chat it was never trained for)

function showNotices(request) {
  // the model's warnings, then the last request's (its options as taken, an edit warning)
  const lines = [...new Set([...modelNotices, ...request])];
  $("play-notices").replaceChildren(...lines.map((notice) => {
    const line = document.createElement("div");
    line.textContent = "\u26a0 " + notice;
    return line;
  }));
}

infoHooks.push((info) => {
  modelNotices = info.notices || [];
  showNotices([]);
});

$("preset").addEventListener("change", () => {
  // the preset's options set; the other options emptied but the first row's (the lengths
  // the user typed stay)
  const preset = playground.presets.find((p) => p.name === $("preset").value);
  const chosen = preset ? preset.options : {};
  const top = new Set(playground.top_row[chosen.decoder || playground.decoder] || []);
  for (const [name, label] of optionLabels) {
    const input = label.querySelector("[data-option]");
    const value = chosen[name];
    if (value !== undefined) input.value = String(value);
    else if (!top.has(name) || name === "decoder") input.value = "";
  }
  placeOptions();
});

// a picture sent with the prompt (a model with a vision tower: /api/info's `images`), as a
// data: URL in the request's image_urls; one over the server's cap is refused here with the
// server's own line, and the server refuses it too
let picture = null;  // {name, url}
let pictureLimit = null;  // bytes of one picture; null: the model takes none

function setPicture(value) {
  picture = value;
  $("picture-shown").hidden = !value;
  $("picture-thumb").src = value ? value.url : "";
  $("picture-thumb").title = value ? value.name : "";
  if (!value) $("picture").value = "";
}

function takePicture(file) {
  if (pictureLimit === null || !file) return;
  if (file.size > pictureLimit) {
    setPicture(null);
    failed(`${file.name} is over this server's ${pictureLimit} bytes per picture; send a smaller picture`);
    return;
  }
  const reader = new FileReader();
  reader.onload = () => {
    setPicture({ name: file.name, url: reader.result });
    $("status").textContent = `picture ${file.name} (${file.size} bytes) goes with the prompt`;
    $("status").classList.remove("play-error");
  };
  reader.readAsDataURL(file);
}

infoHooks.push((info) => {
  pictureLimit = info.images ? info.images.max_bytes : null;
  $("picture-label").hidden = pictureLimit === null;
  if (pictureLimit === null) setPicture(null);
});

$("picture").addEventListener("change", () => takePicture($("picture").files[0]));
$("picture-clear").addEventListener("click", () => setPicture(null));
$("prompt").addEventListener("paste", (event) => {
  const item = [...(event.clipboardData || {}).items || []].find((i) => i.kind === "file" && i.type.startsWith("image/"));
  if (item && pictureLimit !== null) {
    event.preventDefault();
    takePicture(item.getAsFile());
  }
});
$("play").addEventListener("dragover", (event) => { if (pictureLimit !== null) event.preventDefault(); });
$("play").addEventListener("drop", (event) => {
  const file = [...(event.dataTransfer || {}).files || []].find((f) => f.type.startsWith("image/"));
  if (file && pictureLimit !== null) {
    event.preventDefault();
    takePicture(file);
  }
});

function requestBody(prompt) {
  // the options given (empty: the model folder's), top-level or under "unmask" as the API
  // takes them, typed by their kind; a hidden option (its decoder refuses it) is not sent
  const body = { prompt };
  const options = {};
  for (const name of Object.keys(optionKinds)) {
    const input = $("opt-" + name);
    if (!input || input.value === "" || optionLabels.get(name).hidden) continue;
    const { kind, group } = optionKinds[name];
    const value = kind === "bool" ? input.value === "true"
      : kind === "choice" ? input.value : Number(input.value);
    if (group === "openai") body[name] = value;
    else options[name] = value;
  }
  if (Object.keys(options).length) body.unmask = options;
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if (picture) body.image_urls = [picture.url];
  return body;
}

const percent = (p) => (p * 100).toFixed(1) + "%";
const quoted = (token) => JSON.stringify(token);

function tokenTitle(commit, uniform) {
  if (uniform) {
    const changes = commit.changes ? `, renoised ${commit.changes} time${commit.changes > 1 ? "s" : ""}` : "";
    const p = commit.p !== null && commit.p !== undefined ? ` (p ${percent(commit.p)})` : "";
    return `drawn at step ${commit.since}${changes}${p}`;
  }
  let title = `committed at step ${commit.step}`;
  if (commit.p !== null && commit.p !== undefined) title += ` (p ${percent(commit.p)})`;
  for (const edit of commit.edits) title += `; edited at step ${edit.step} from ${quoted(edit.from)}`;
  return title;
}

function drawCanvas(prompt, event, previous, history, uniform) {
  // history[i]: position i's commit {step, p, edits: [{step, from}]} (uniform: {since,
  // changes}); event.proposed / probability: this step's proposal at each position that
  // was a mask before it. An edit: a committed token replaced by another.
  const tokens = event.canvas;
  const box = $("canvas");
  box.textContent = "";
  const head = document.createElement("span");
  head.className = "prompt";
  head.textContent = prompt;
  box.appendChild(head);
  tokens.forEach((token, i) => {
    const span = document.createElement("span");
    const proposed = event.proposed ? event.proposed[i] : null;
    const p = event.probability ? event.probability[i] : null;
    const before = previous ? previous[i] : undefined;
    if (token === null) {
      span.className = "mask";
      span.textContent = MASK;
      if (proposed !== null && p !== null) {
        span.title = `mask: step ${event.step} proposed "${proposed}" (p ${percent(p)}), not committed`;
        span.dataset.p = String(p);
      }
      history[i] = undefined;
    } else {
      span.className = token === "\u00b7" ? "tok eos" : "tok";
      let commit = history[i];
      if (uniform) {
        if (!commit) commit = history[i] = { since: event.step, changes: 0 };
        else if (before !== undefined && before !== token) {
          commit.since = event.step;
          commit.changes += 1;
          span.classList.add("new");
        }
        commit.p = p;  // this step's probability of the token shown (null: not sent)
      } else if (!commit || before === null || before === undefined) {
        commit = history[i] = { step: event.step, p, edits: [] };
        span.classList.add("new");
      } else if (before !== token) {
        commit.edits.push({ step: event.step, from: before });
        span.classList.add("new");
      }
      if (!uniform && commit.edits.length) {
        span.classList.add("edited");
        span.dataset.edits = String(commit.edits.length);
      }
      span.title = tokenTitle(commit, uniform);
      if (commit.p !== null && commit.p !== undefined) {
        span.dataset.p = String(commit.p);
        if (!uniform && commit.p < LOW) span.classList.add("low");
      }
      span.textContent = token;
    }
    box.appendChild(span);
  });
  box.dataset.step = String(event.step);
  box.dataset.masks = String(tokens.filter((t) => t === null).length);
}

function changeCount(history, uniform) {
  // edits (masked) or renoisings (uniform) so far, and the positions they touched
  let count = 0, positions = 0;
  for (const commit of history) {
    if (!commit) continue;
    const n = uniform ? commit.changes : commit.edits.length;
    count += n;
    if (n) positions += 1;
  }
  return { count, positions };
}

function changeText(history, uniform) {
  const { count, positions } = changeCount(history, uniform);
  if (uniform) return `${count} token${count === 1 ? "" : "s"} renoised`;
  return `${count} edit${count === 1 ? "" : "s"}` + (count ? ` (${positions} token${positions === 1 ? "" : "s"})` : "");
}

function clearCanvas() {
  // an error: the previous answer must not stay drawn above it as if it were this one's
  const box = $("canvas");
  box.textContent = "";
  box.dataset.step = "0";
  box.dataset.masks = "0";
  box.dataset.edits = "";
  box.dataset.text = "";
}

function failed(message) {
  clearCanvas();
  $("canvas").dataset.error = "1";
  $("status").textContent = "error: " + message;
  $("status").classList.add("play-error");
}

async function unmask() {
  const prompt = $("prompt").value;
  const body = requestBody(prompt);
  const uniform = playground.uniform_canvas;
  $("status").textContent = "decoding...";
  $("status").classList.remove("play-error");
  showNotices([]);
  $("run").disabled = true;
  const fail = failed;
  try {
    const response = await fetch("/v1/unmask/canvas", {
      method: "POST", headers: headers(), body: JSON.stringify(body),
    });
    if (!response.ok) {
      const error = await response.json();
      fail(error.error.message);
      return;
    }
    let previous = null;
    const history = [];
    for await (const event of serverEvents(response)) {
      if (event.error) {
        fail(event.error.message);
      } else if (event.done) {
        const { count } = changeCount(history, uniform);
        $("status").textContent = `done: ${event.finish_reason}, ${event.forwards} forward passes, ${changeText(history, uniform)}`;
        $("canvas").dataset.edits = String(count);
        $("canvas").dataset.done = "1";
        $("canvas").dataset.forwards = String(event.forwards);
        $("canvas").dataset.text = event.text;
        showNotices(event.notices || []);
      } else {
        drawCanvas(prompt, event, previous, history, uniform);
        previous = event.canvas;
        const { count } = changeCount(history, uniform);
        $("canvas").dataset.edits = String(count);
        $("status").textContent = `step ${event.step}, ${changeText(history, uniform)} so far`;
        await sleep(Number($("delay").value) || 0);
      }
    }
  } catch (err) {
    fail(err.message);
  } finally {
    $("run").disabled = false;
  }
}

$("run").addEventListener("click", () => {
  $("canvas").dataset.done = "";
  $("canvas").dataset.error = "";
  unmask();
});
