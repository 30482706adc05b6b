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

// -- axis ticks (the Runs charts, the Train tab's curve) ----------------------------------
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

