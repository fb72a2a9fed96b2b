"""The inference wing: a trained model put to use. `captioner` (encoder + decoder + tokenizer from
a checkpoint folder), `decoding` (greedy, sampling and beam search on the step contract),
`controls` and `shaping` (the caption controls: their values, and how they shape a step),
`ensemble`, `rerank` (MBR), `shipped` (the models in the wheel), `figures` (attention panels), `writer`
(resumable JSON/JSONL/CSV caption outputs), `zero_shot` (vision-language models and their prompt
templates, `vlm_prompts.toml`), `ray_engine` (captioning and features on Ray).

May import: `models`, `encoders`, `kernels`, `data`, `scoring`, `core`."""
