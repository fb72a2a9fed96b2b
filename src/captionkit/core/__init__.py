"""The core wing: what every other wing stands on. One-line user errors (`errors`), the cache
folders (`cache`), the tables of named parts (`registry`), config field checks (`fields`), the one
rule for writing outputs (`outputs`), safetensors + JSON checkpoints (`checkpoint`), device and
precision choice (`devices`, `precision`), how many model processes a CPU job runs
(`process_count`), all Hugging Face loading (`hf`), the version.

May import: nothing else of captionkit (pyproject.toml's import-linter contracts enforce it)."""
