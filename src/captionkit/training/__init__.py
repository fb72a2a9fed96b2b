"""The training wing. `run` (a run's checks, its folder and `train`), `stages` (the stages a
trainer is built from: prepare_data, build_tokenizer, build_model, build_optimizer), `trainer`
(the loop, `Trainer`, `TrainState`), `config` (the TOML config as checked dataclasses), `scst`
(self-critical training), `glove`, `tblog` (TensorBoard), `distributed` (torchrun/DDP).

May import: `inference` and every wing below it."""
