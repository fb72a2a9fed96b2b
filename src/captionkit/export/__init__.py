"""The export wing: `exporters` (ONNX graphs with int8 and a parity check, Hugging Face
transformers folders, the in-browser page) and `onnx_runtime` (the step contract over
onnxruntime, for the parity check and captioning from an export).

May import: `inference` and every wing below it; not `serve`, `experiments` or `cli`."""
