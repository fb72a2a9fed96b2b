"""The scoring wing: coco-caption's scorers with numpy only. `evaluation` (corpus and per-image
scores, METEOR jar or nltk, bootstrap intervals, paired tests), `metrics` (BLEU, ROUGE-L, CIDEr-D),
`ptb`/`ptb_tokenize` (the PTB tokenizer, Java or Python), `score_inputs` (the shapes of caption
and reference files), `diversity` (vocabulary, distinct and novel captions, Div-n, repetition,
mBLEU-4, Self-CIDEr, and the references' human row).

May import: `captionkit.core`'s torch-free modules (`errors`, `cache`, `outputs`). No torch is
imported from here, directly or through another module: `captionkit score` runs without it
(import-linter's contract and tests/test_layers.py check it)."""
