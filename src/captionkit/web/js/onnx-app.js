// The in-browser demo: loads an export of `captionkit export onnx` (manifest.json and the
// graphs) from ?model=URL (default: this page's folder) and captions photos on the client.
import * as ort from "../vendor/ort/ort.wasm.min.mjs";
import { fileInput, showResult } from "./attention.js";
import { caption, Graphs } from "./decode.js";
import { rgbaToRgb, toTensorData } from "./preprocess.js";

const $ = (id) => document.getElementById(id);
const status = $("status");
const params = new URLSearchParams(location.search);
const base = new URL(params.get("model") || "./", location.href);
ort.env.wasm.numThreads = 1; // no cross-origin isolation needed
ort.env.wasm.wasmPaths = new URL("../vendor/ort/", import.meta.url).href;

let manifest = null, graphs = null, lastFile = null;

function fail(e) { status.className = "status error"; status.textContent = String(e && e.message || e); }

async function loadGraphs() {
  status.textContent = `loading ${$("variant").value} graphs…`;
  graphs = await Graphs.load(ort, base, manifest, $("variant").value);
  status.textContent = `${manifest.model}: ready`;
  document.body.dataset.ready = "1";
}

async function init() {
  const res = await fetch(new URL("manifest.json", base));
  if (!res.ok) throw new Error(`no manifest.json at ${base} (${res.status})`);
  manifest = await res.json();
  for (let b = 1; b <= 5; b++) $("beam").add(new Option(String(b), String(b), b === 3, b === 3));
  for (const v of Object.keys(manifest.graphs)) $("variant").add(new Option(v, v));
  if (params.get("beam")) $("beam").value = params.get("beam");
  await loadGraphs();
}

// The photo's pixels as decoded, without colour management or EXIF rotation (as Pillow reads them).
async function pixels(file) {
  const bmp = await createImageBitmap(file, { colorSpaceConversion: "none", premultiplyAlpha: "none", imageOrientation: "none" });
  const c = new OffscreenCanvas(bmp.width, bmp.height);
  const ctx = c.getContext("2d", { willReadFrequently: true });
  ctx.drawImage(bmp, 0, 0);
  const data = ctx.getImageData(0, 0, bmp.width, bmp.height).data;
  return { rgb: rgbaToRgb(data, bmp.width, bmp.height), w: bmp.width, h: bmp.height };
}

async function captionFile(file) {
  lastFile = file;
  if (!graphs) return;
  status.className = "status";
  status.textContent = "captioning…";
  const t0 = performance.now();
  const { rgb, w, h } = await pixels(file);
  const input = toTensorData(rgb, w, h, manifest.preprocess);
  const beam = Number($("beam").value);
  const result = await caption(graphs, input, beam);
  status.textContent = `${manifest.model}, beam ${beam}, ${Math.round(performance.now() - t0)} ms in this browser`;
  showResult($("result"), URL.createObjectURL(file), result);
  window.captionkitLast = { ...result, input_sample: Array.from(input.subarray(0, 16)) };
  document.body.dataset.captioned = String(Number(document.body.dataset.captioned || 0) + 1);
}

fileInput($("drop"), $("file"), (f) => captionFile(f).catch(fail));
$("beam").addEventListener("change", () => lastFile && captionFile(lastFile).catch(fail));
$("variant").addEventListener("change", () => loadGraphs().then(() => lastFile && captionFile(lastFile)).catch(fail));
init().catch(fail);
