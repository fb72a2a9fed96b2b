import { fileInput, showResult } from "./attention.js";

const $ = (id) => document.getElementById(id);
const status = $("status");
let lastFile = null;
const KEY_ITEM = "captionkit-api-key";

// A server started with an API key answers 401 on /v1/: ask for the key once, keep it for the tab.
async function api(url, options = {}) {
  for (;;) {
    const key = sessionStorage.getItem(KEY_ITEM);
    const res = await fetch(url, key ? { ...options, headers: { Authorization: `Bearer ${key}` } } : options);
    if (res.status !== 401) return res;
    const given = window.prompt("This server needs an API key:");
    if (!given || !given.trim()) return res;
    sessionStorage.setItem(KEY_ITEM, given.trim());
  }
}

async function init() {
  const res = await api("/v1/models");
  const info = await res.json();
  if (!res.ok) throw new Error(info.error || `error ${res.status}`);
  for (const m of info.models) {
    const o = new Option(`${m.name} (${m.family}, ${m.encoder})`, m.name, m.default, m.default);
    $("model").add(o);
  }
  for (let b = 1; b <= Math.min(info.limits.max_beam, 10); b++) {
    $("beam").add(new Option(String(b), String(b), b === info.limits.default_beam, b === info.limits.default_beam));
  }
  if (info.onnx_demo) { $("onnx-link").href = info.onnx_demo; $("onnx-link").hidden = false; }
  document.body.dataset.ready = "1";
}

async function captionFile(file) {
  lastFile = file;
  const form = new FormData();
  form.append("image", file);
  form.append("beam", $("beam").value);
  form.append("model", $("model").value);
  status.className = "status";
  status.textContent = "captioning…";
  const res = await api("/v1/caption", { method: "POST", body: form });
  const body = await res.json();
  if (!res.ok) {
    status.className = "status error";
    status.textContent = body.error || `error ${res.status}`;
    return;
  }
  status.textContent = `${body.model}, beam ${body.beam}, ${body.elapsed_ms} ms`;
  showResult($("result"), URL.createObjectURL(file), body);
  document.body.dataset.captioned = String(Number(document.body.dataset.captioned || 0) + 1);
}

fileInput($("drop"), $("file"), captionFile);
for (const id of ["beam", "model"]) $(id).addEventListener("change", () => lastFile && captionFile(lastFile));
init().catch((e) => { status.className = "status error"; status.textContent = String(e); });
