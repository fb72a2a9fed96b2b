import { fileInput, showResult } from "./attention.js";

const $ = (id) => document.getElementById(id);
const status = $("status");
let lastFile = null;

async function init() {
  const info = await (await fetch("/v1/models")).json();
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
  const res = await fetch("/v1/caption", { method: "POST", body: form });
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
