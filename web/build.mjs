// Copy the parts of onnxruntime-web the demo loads (the wasm-only ES module build, its
// worker-less loader and the SIMD wasm binary) into the Python package's static folder.
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const dist = join(here, "node_modules", "onnxruntime-web", "dist");
const out = join(here, "..", "src", "captionkit", "web", "vendor", "ort");
mkdirSync(out, { recursive: true });
for (const f of ["ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm"]) {
  copyFileSync(join(dist, f), join(out, f));
}
console.log(`onnxruntime-web copied to ${out}`);
