// The page of `unmask serve`, shared parts (the tabs, the key, helpers): play.js is the
// playground (the canvas after every denoising step, from POST /v1/unmask/canvas), runs.js
// the runs of --runs DIR (GET /api/runs, /api/runs/NAME). No libraries: the page works
// offline. Everything drawn from the server (run names, model names, tokens, error
// messages) goes in as text (textContent, setAttribute), never as HTML; the server's
// Content-Security-Policy forbids inline script and style besides.
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

// what each tab runs when shown (runs.js registers its refresh)
const tabHooks = {};
// what runs once /api/info has answered, given its body (play.js builds its options form)
const infoHooks = [];

function showTab(name) {
  for (const b of document.querySelectorAll("header button[data-tab]")) {
    b.classList.toggle("on", b.dataset.tab === name);
  }
  for (const s of document.querySelectorAll("main section")) s.classList.toggle("on", s.id === name);
  for (const hook of tabHooks[name] || []) hook();
}


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

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

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
