// The playground (common.js holds the shared helpers).
"use strict";

// The presets the playground names, the published samplers: each sets these options (and
// clears the other options of the form); "the model folder's" sends none of them. Every
// option (the decoder strategy too) stays editable under "every option".
const PRESETS = [
  ["", "the model folder's", {}],
  ["llada", "LLaDA: low confidence, per-block quotas", { remasking: "low_confidence", schedule: "llada" }],
  ["dream", "Dream: entropy, dream timesteps", { remasking: "entropy", schedule: "dream" }],
  ["fastdllm", "Fast-dLLM: threshold 0.9, dual cache", { threshold: 0.9, cache: "dual" }],
  ["mdlm", "MDLM: ancestral (origin, ddpm cache)", { remasking: "origin", ddpm_cache: true }],
  ["random", "random order", { remasking: "random" }],
];
// options of the first row (the rest are built from /api/info under "every option")
const FIRST_ROW = ["max_tokens", "steps", "block_length", "temperature"];
// below this probability a committed token is marked (the legend's "low confidence")
const LOW = 0.5;
let optionKinds = {};  // name -> {kind, group}

function buildOptions(info) {
  const box = $("options");
  box.textContent = "";
  optionKinds = {};
  for (const option of info.sampling_options || []) {
    optionKinds[option.name] = option;
    if (FIRST_ROW.includes(option.name)) {
      $("opt-" + option.name).placeholder = option.value === null ? "default" : String(option.value);
      continue;
    }
    const label = document.createElement("label");
    label.appendChild(document.createTextNode(option.name + " "));
    label.title = option.doc;
    let input;
    if (option.kind === "choice" || option.kind === "bool") {
      input = document.createElement("select");
      const values = option.kind === "bool" ? ["true", "false"] : option.choices;
      for (const value of ["", ...values]) {
        const item = document.createElement("option");
        item.value = value;
        item.textContent = value === "" ? `(${option.value})` : value;
        input.appendChild(item);
      }
    } else {
      input = document.createElement("input");
      input.type = "number";
      input.className = "num";
      if (option.kind === "float") input.step = "any";
      input.placeholder = option.value === null ? "off" : String(option.value);
    }
    input.id = "opt-" + option.name;
    input.dataset.option = option.name;
    label.appendChild(input);
    box.appendChild(label);
  }
}

infoHooks.push(buildOptions);
infoHooks.push((info) => {  // warnings about the model (a chat it was never trained for)
  $("play-notices").replaceChildren(...(info.notices || []).map((notice) => {
    const line = document.createElement("div");
    line.textContent = "\u26a0 " + notice;
    return line;
  }));
});

for (const [value, label] of PRESETS) {
  const item = document.createElement("option");
  item.value = value;
  item.textContent = label;
  $("preset").appendChild(item);
}

$("preset").addEventListener("change", () => {
  const chosen = PRESETS.find((d) => d[0] === $("preset").value)[2];
  for (const input of $("options").querySelectorAll("[data-option]")) {
    const value = chosen[input.dataset.option];
    input.value = value === undefined ? "" : String(value);
  }
});

function requestBody(prompt) {
  // the options given (empty: the model folder's), top-level or under "unmask" as the API
  // takes them, typed by their kind
  const body = { prompt };
  const options = {};
  for (const name of Object.keys(optionKinds)) {
    const input = $("opt-" + name);
    if (!input || input.value === "") continue;
    const { kind, group } = optionKinds[name];
    const value = kind === "bool" ? input.value === "true"
      : kind === "choice" ? input.value : Number(input.value);
    if (group === "openai") body[name] = value;
    else options[name] = value;
  }
  if (Object.keys(options).length) body.unmask = options;
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  return body;
}

const percent = (p) => (p * 100).toFixed(1) + "%";

function drawCanvas(prompt, event, previous, history) {
  // history[i]: {step, p} of position i's commit; event.proposed / probability: this
  // step's proposal at each position that was a mask before it
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
    if (token === null) {
      span.className = "mask";
      span.textContent = MASK;
      if (proposed !== null && p !== null) {
        span.title = `mask: step ${event.step} proposed "${proposed}" (p ${percent(p)}), not committed`;
        span.dataset.p = String(p);
      }
    } else {
      span.className = token === "\u00b7" ? "tok eos" : "tok";
      if (previous && previous[i] === null) {
        span.classList.add("new");
        history[i] = { step: event.step, p };
      }
      const commit = history[i];
      if (commit && commit.p !== null && commit.p !== undefined) {
        span.title = `committed at step ${commit.step} (p ${percent(commit.p)})`;
        span.dataset.p = String(commit.p);
        if (commit.p < LOW) span.classList.add("low");
      } else if (commit) {
        span.title = `committed at step ${commit.step}`;
      }
      span.textContent = token;
    }
    box.appendChild(span);
  });
  box.dataset.step = String(event.step);
  box.dataset.masks = String(tokens.filter((t) => t === null).length);
}

async function unmask() {
  const prompt = $("prompt").value;
  const body = requestBody(prompt);
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
    const history = [];
    for await (const event of serverEvents(response)) {
      if (event.error) {
        $("status").textContent = "error: " + event.error.message;
      } else if (event.done) {
        $("status").textContent = `done: ${event.finish_reason}, ${event.forwards} forward passes`;
        $("canvas").dataset.done = "1";
        $("canvas").dataset.forwards = String(event.forwards);
      } else {
        if (previous === null) previous = event.canvas.map(() => null);
        drawCanvas(prompt, event, previous, history);
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
