// The playground (common.js holds the shared helpers).
"use strict";

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
