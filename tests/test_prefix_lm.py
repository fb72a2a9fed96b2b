"""The prefix-LM family on a tiny random LLaMA (2 layers, width 32) with a byte-level BPE
tokenizer trained here on the synthetic shapes captions, both saved to a temporary folder:
no network. Merged LoRA against unmerged, which parameters a training step changes in each
freezing mode, the KV-cached steps against the teacher-forced forward, the ``lm`` tokenizer, a
trainer run through the checkpoint and the command line, and the merged-LoRA export. (What
every family must do -- beam 1 against greedy, shared images, rescoring -- is asserted in
test_model_contract.py.)"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from helpers import shape_image, write_lm_config  # noqa: E402

from captionkit.cli.main import main  # noqa: E402
from captionkit.core.checkpoint import ENCODER_PREFIX, read_config, read_weights  # noqa: E402
from captionkit.core.errors import WeightsUnavailable  # noqa: E402
from captionkit.data.tokenizers import LMTokenizer, load_tokenizer  # noqa: E402
from captionkit.inference.captioner import Captioner  # noqa: E402
from captionkit.models import create_model  # noqa: E402
from captionkit.models.prefix_lm import param_group  # noqa: E402
from captionkit.training.config import RunConfig  # noqa: E402
from captionkit.training.run import build_trainer, train  # noqa: E402

GRID = [7, 7]  # efficientnet_lite0's grid, the encoder of the trainer tests


def model_of(lm: str, **cfg):
    torch.manual_seed(0)
    vocab = len(LMTokenizer.build(lm))
    return create_model("prefix_lm", {"vocab_size": vocab, "feat_dim": 24, "grid": GRID, "lm": lm,
                                        "pool": [2, 2], "lora_dropout": 0.0, **cfg}).eval()


def caption_ids(tok: LMTokenizer, B: int = 3) -> torch.Tensor:
    """(B, T+1): <start> words <end> of equal length."""
    ids = [tok.encode(["a", "red", "circle"]), tok.encode(["one", "blue", "square"]), tok.encode(["the", "dog"])]
    T = max(map(len, ids))
    return torch.tensor([i + [0] * (T - len(i)) for i in ids[:B]])


def test_lm_tokenizer_keeps_the_special_ids_and_gives_words(tiny_lm):
    tok = LMTokenizer.build(tiny_lm)
    ids = tok.encode(["a", "red", "circle", "on", "a", "white", "background"])
    assert ids[0] == tok.start and ids[-1] == tok.end and min(ids[1:-1]) >= 4
    assert tok.decode(ids) == ["a", "red", "circle", "on", "a", "white", "background"]
    spans = tok.spans(ids)
    assert [w for w, _ in spans] == tok.decode(ids) and spans[0][1] == [1]
    covered = [p for _, where in spans for p in where]
    assert covered == sorted(set(covered))  # each token in one word at most, in order
    # a token left out is whitespace between words
    assert all(tok.tok.decode([ids[p] - 4]).isspace() for p in range(1, len(ids) - 1) if p not in covered)
    # words the way training captions are normalised: lower case, punctuation dropped
    raw = [i + 4 for i in tok.tok.encode("The dogs' ball, in a park!", add_special_tokens=False)]
    assert tok.decode([tok.start] + raw + [tok.end]) == ["the", "dogs", "ball", "in", "a", "park"]
    again = load_tokenizer(tok.to_json())
    assert isinstance(again, LMTokenizer) and len(again) == len(tok) and again.encode(["a", "dog"]) == tok.encode(["a", "dog"])


# the installed transformers' own way of passing the cache (captionkit.core.hf.with_cache): a
# deprecated keyword warns (FutureWarning), and stops working in a later release
@pytest.mark.filterwarnings("error::FutureWarning")
def test_kv_cached_steps_give_the_teacher_forced_log_probs(tiny_lm):
    tok = LMTokenizer.build(tiny_lm)
    for projector in ("mlp", "transformer"):
        model = model_of(tiny_lm, projector=projector, mapper_heads=4, mapper_tokens=3, lm_training="lora")
        feats = torch.randn(3, GRID[0] * GRID[1], 24)
        ids = caption_ids(tok)[:2]  # (2, T+1)
        with torch.no_grad():
            full, _ = model(feats[:2], ids[:, :-1])  # (B, T, V) log-probs
            mem = model.prepare(feats[:2])
            state = model.init_state(mem)
            for t in range(ids.shape[1] - 1):
                logp, state, attention = model.step(ids[:, t], state, mem)
                torch.testing.assert_close(logp, full[:, t], atol=1e-5, rtol=1e-5)
                assert attention.shape == (2, GRID[0] * GRID[1])
                torch.testing.assert_close(attention.sum(1), torch.ones(2))
        assert state[0].shape[2] == model.cfg.prefix_len + ids.shape[1] - 1  # the cache grew one per step
        assert torch.isinf(full[..., [0, 1, 3, 4 + model.eos_id]]).all()  # <end> is the only way to stop


def test_merged_lora_gives_the_unmerged_logits(tiny_lm):
    model = model_of(tiny_lm, lm_training="lora", lora_rank=4, lora_targets=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():  # LoRA's B starts at zero, which would make any merge look exact
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    feats = torch.randn(2, GRID[0] * GRID[1], 24)
    ids = caption_ids(LMTokenizer.build(tiny_lm))[:2, :-1]
    with torch.no_grad():
        unmerged = model.lm_logits(feats, ids)
        plain = model.lm.get_base_model()
        base = model.lm.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.clone()
        merged_lm = model.standalone_lm()
        assert type(merged_lm).__name__ == "LlamaForCausalLM" and merged_lm is plain
        assert not any("lora" in n for n, _ in merged_lm.named_parameters())
        assert not torch.equal(merged_lm.model.layers[0].self_attn.q_proj.weight, base)  # really merged
        prefix = model.prefix(feats)
        merged = merged_lm(inputs_embeds=torch.cat([prefix, merged_lm.get_input_embeddings()(model.lm_ids(ids))], 1),
                           logits_to_keep=ids.shape[1]).logits
    assert unmerged.abs().max() > 0.1
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-4)


def test_missing_lm_source_is_one_clear_error(tiny_lm, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    missing = str(tmp_path / "no_such_lm")
    with pytest.raises(WeightsUnavailable, match="no_such_lm.*no such folder"):
        create_model("prefix_lm", {"vocab_size": 10, "lm": missing})
    (tmp_path / "empty_lm").mkdir()
    with pytest.raises(WeightsUnavailable, match="empty_lm.*holds no loadable model"):
        create_model("prefix_lm", {"vocab_size": 10, "lm": str(tmp_path / "empty_lm")})
    with pytest.raises(WeightsUnavailable, match="'captionkit-tests/no-such-model' is neither a folder nor in "
                                                 "the local Hugging Face cache"):
        create_model("prefix_lm", {"vocab_size": 10, "lm": "captionkit-tests/no-such-model"})
    # a checkpoint short of a tensor: never random weights in its place
    broken = shutil.copytree(tiny_lm, tmp_path / "broken_lm")
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsUnavailable, match="broken_lm.*lacks 1 tensors.*up_proj"):
        model_of(str(broken))


def test_config_fields_are_checked(tiny_lm):
    with pytest.raises(ValueError, match="PrefixLMConfig.projector"):
        create_model("prefix_lm", {"vocab_size": 10, "lm": tiny_lm, "projector": "rnn"})
    with pytest.raises(ValueError, match="PrefixLMConfig.vocab_size .* data.tokenizer = \"lm\""):
        create_model("prefix_lm", {"vocab_size": 10, "lm": tiny_lm})
    with pytest.raises(ValueError, match="unfreeze_after"):
        model_of(tiny_lm, lm_training="blocks", unfreeze_after=2)


def write_config(path: Path, dataset: Path, lm: str, epochs: int = 1, model: str = "", train: str = "") -> Path:
    model_lines = f'family = "prefix_lm"\nlm = "{lm}"\npool = [2, 2]\nprojector = "mlp"\nprojector_hidden = 32\n' \
                  f'lora_rank = 4\nlora_dropout = 0.0\n{model}'
    return write_lm_config(path, dataset, 'name = "efficientnet_lite0"\nweights = "random"', model_lines, epochs,
                           f"alpha_c = 0.0\n{train}")


MODES = {  # name: ([model] lines, [train] lines, the parameter groups that must change)
    "projector": ('lm_training = "frozen"', "", {"projector"}),
    "lora": ('lm_training = "lora"', "lr_groups = { lora = 1e-2 }", {"projector", "lora"}),
    "blocks": ('lm_training = "blocks"\nunfreeze_after = 1', "lr_groups = { projector = 1e-3, lm_blocks = 1e-4 }",
               {"projector", "lm_blocks"}),
    "lora_encoder": ('lm_training = "lora"', "finetune_blocks = 1\nencoder_lr = 1e-3", {"projector", "lora", "encoder"}),
}


def group_of(name: str) -> str:
    if name.startswith(ENCODER_PREFIX):
        return "encoder"
    return param_group(name)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_training_step_changes_exactly_the_chosen_groups(mode, tiny_lm, flickr_dir, tmp_path):
    model_lines, train_lines, groups = MODES[mode]
    cfg = RunConfig.load(write_config(tmp_path / "c.toml", flickr_dir, tiny_lm, model=model_lines, train=train_lines))
    trainer = build_trainer(cfg, tmp_path / "run", vocab=LMTokenizer.build(tiny_lm))

    def snapshot() -> dict[str, torch.Tensor]:
        own = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return own | {ENCODER_PREFIX + n: p.detach().clone() for n, p in trainer.data.encoder.named_parameters()}

    before = snapshot()
    trainer.fit(max_steps=2, progress=False)  # two steps: LoRA's A has no gradient while B is still zero
    after = snapshot()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainable |= {ENCODER_PREFIX + n for n, p in trainer.data.encoder.named_parameters() if p.requires_grad}
    assert changed == trainable  # everything trained moved, nothing else did
    assert {group_of(n) for n in changed} == groups
    if mode == "blocks":  # the LM's second block and final norm, not the first block or the embeddings
        assert all(".layers.1." in n or "model.norm" in n for n in changed if group_of(n) == "lm_blocks")
    # each named group at its own learning rate (the schedule's factor is 1 here)
    lrs = [g["lr"] for g in trainer.opt.param_groups]
    expected = {"projector": [3e-3], "lora": [3e-3, 1e-2], "blocks": [1e-3, 1e-4], "lora_encoder": [3e-3, 3e-3, 1e-3]}
    assert lrs == pytest.approx(expected[mode])
    # the checkpoint holds what was trained and nothing else
    saved = set(read_weights(tmp_path / "run" / "last"))
    assert saved == trainable
    # the trained-parameter count, per group, as printed and saved for the model card
    numel = snapshot()
    counts = {g: sum(numel[n].numel() for n in changed if group_of(n) == g) for g in groups}
    assert read_config(tmp_path / "run" / "last")["trained_parameters"] == counts | {"total": sum(counts.values())}


@pytest.fixture(scope="module")
def lora_run(tiny_lm, flickr_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prefix_run")
    cfg = write_config(out / "lora.toml", flickr_dir, tiny_lm, epochs=4, model='lm_training = "lora"',
                       train="lr_groups = { projector = 1e-2, lora = 5e-2 }")
    train(cfg, out=out / "run", progress=False)
    return out / "run"


@pytest.mark.slow  # the lora_run fixture: a training run
def test_trainer_run_saves_only_trained_tensors_and_captions_from_the_command_line(lora_run, tiny_lm, tmp_path,
                                                                                    capsys):
    cfg = read_config(lora_run / "best")
    assert cfg["family"] == "prefix_lm" and cfg["model"]["lm"] == tiny_lm
    assert cfg["vocab"] == {"kind": "lm", "source": tiny_lm, "size": cfg["model"]["vocab_size"]}
    saved = read_weights(lora_run / "best")
    assert saved and all(k.startswith("projector.") or "lora_" in k for k in saved)  # no LM weights
    cap = Captioner.load(lora_run / "best")
    assert set(saved) == cap.decoder.trained
    assert type(cap.decoder).__name__ == "PrefixLMCaptioner"
    shape_image(0, size=80).save(tmp_path / "photo.jpg")
    rc = main(["caption", "--model", str(lora_run / "best"), "--beam", "2", str(tmp_path / "photo.jpg")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    name, caption = out.strip("\n").split("\t")
    assert name == "photo.jpg" and caption.split()
    # merge-lora: a plain transformers folder, and a captioner on it that writes the same caption
    rc = main(["merge-lora", "--model", str(lora_run / "best"), "--out", str(tmp_path / "merged")])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    assert (tmp_path / "merged" / "model.safetensors").is_file() and (tmp_path / "merged" / "tokenizer.json").is_file()
    from transformers import AutoModelForCausalLM
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "merged")).__name__ == "LlamaForCausalLM"
    rc = main(["caption", "--model", str(tmp_path / "merged" / "captioner"), "--beam", "2", str(tmp_path / "photo.jpg")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip("\n").split("\t") == [name, caption]


@pytest.mark.slow  # the lora_run fixture: a training run
def test_a_checkpoint_whose_lm_is_gone_fails_in_one_line(lora_run, tmp_path, capsys):
    import json
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(lora_run / "best", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model"]["lm"] = cfg["vocab"]["source"] = str(tmp_path / "deleted_lm")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    shape_image(0, size=80).save(tmp_path / "photo.jpg")
    rc = main(["caption", "--model", str(ckpt), str(tmp_path / "photo.jpg")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "deleted_lm" in err and "no such folder" in err
