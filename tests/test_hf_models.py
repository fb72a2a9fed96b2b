"""Hugging Face image-to-text models as captionkit families (models/hf_captioner.py, hf_families.py,
inference/hf_models.py), on tiny random BLIP, GIT, VisionEncoderDecoderModel and Idefics3 (SmolVLM's
architecture) models saved with save_pretrained (hf_tiny.py; no network), each architecture through:

- decoding: captionkit's greedy steps give the tokens of the model's own ``generate``; the
  teacher-forced logits are those of the model's own forward over image, prompt and caption; the
  encoder's rows, normalised by the family, are the model's processor's pixel values;
- ``--model hf:FOLDER``: caption (JSONL, a bad image, resuming), evaluate, serve, the Python API, a
  bf16 CPU run; the prompt an instruction-tuned model gets;
- fine-tuning: which tensors a training step trains per ``training`` setting; captionkit's trainer
  with LoRA stopped and resumed to the unbroken run's weights; full fine-tuning; ``export hf``
  folders that transformers' ``from_pretrained`` loads and captions with as the checkpoint does;
- the one-line refusals.

(What every family must do -- steps against teacher forcing, beam 1 against greedy, shared images,
rescoring, checkpoints, the meta-device checks -- is asserted in test_model_contract.py and
test_meta_contract.py, which build these families from the same tiny models.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from helpers import local_ray, shape_image, write_lm_config  # noqa: E402
from meta_models import HF_FAMILIES, HF_PROMPT  # noqa: E402

from captionkit.cli.main import main  # noqa: E402
from captionkit.core.checkpoint import read_config, read_weights  # noqa: E402
from captionkit.core.errors import UserError  # noqa: E402
from captionkit.data.images import load_rgb, to_tensor  # noqa: E402
from captionkit.data.tokenizers import LMTokenizer  # noqa: E402
from captionkit.data.vocab import Vocab  # noqa: E402
from captionkit.encoders import create_encoder  # noqa: E402
from captionkit.inference.captioner import Captioner  # noqa: E402
from captionkit.inference.decoding import greedy  # noqa: E402
from captionkit.models import create_model  # noqa: E402
from captionkit.models.hf_captioner import PROMPT_FILE, reference_config  # noqa: E402
from captionkit.training.run import train  # noqa: E402

ARCHS = ["blip", "git", "ved", "idefics3"]


@pytest.fixture(autouse=True)
def _git_needs_its_transformers(request):
    """hf_git refuses transformers before GIT_MIN_TRANSFORMERS (an H200 machine had 5.17):
    there its tests say why they did not run instead of failing on the refusal."""
    from captionkit.models.hf_families import check_git_transformers

    spec = getattr(request.node, "callspec", None)
    if spec is not None and spec.params.get("arch") == "git":
        try:
            check_git_transformers()
        except UserError as e:
            pytest.skip(str(e))


def test_git_refuses_a_transformers_it_was_not_checked_on(monkeypatch):
    import transformers

    from captionkit.models.hf_families import check_git_transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(UserError, match=r"hf_git needs transformers >= 5\.24 \(this environment has 5\.17\.0\)"):
        check_git_transformers()
    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    check_git_transformers()


FAMILY = {arch: family for family, arch in HF_FAMILIES.items()}
CLASS = {"blip": "BlipForConditionalGeneration", "git": "GitForCausalLM", "ved": "VisionEncoderDecoderModel",
         "idefics3": "Idefics3ForConditionalGeneration"}


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the tiny models' steps are a few milliseconds of small matrices, which a
    second thread slows (tenfold on the shared 2-core machine) rather than speeds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prompt_of(arch: str) -> str:
    return HF_PROMPT if arch == "idefics3" else ""


def model_of(source: str, arch: str, training: str = "frozen", **cfg):
    torch.manual_seed(0)
    model = create_model(FAMILY[arch], {**reference_config(source, prompt_of(arch)), "training": training,
                                        "lora_rank": 2, "lora_dropout": 0.0, **cfg})
    return model.eval()


def feats_for(model, n: int = 3, seed: int = 1) -> torch.Tensor:
    """Random hf_pixels rows (n, H*W, 3*p*p) in [0, 1]."""
    H, W = model.cfg.grid
    return torch.rand(n, H * W, model.cfg.feat_dim, generator=torch.Generator().manual_seed(seed))


def hf_generate(model, arch: str, feats: torch.Tensor, max_new: int, core=None) -> list[list[int]]:
    """The transformers model's own greedy generate (``core``: another model of the same
    architecture, e.g. an exported one) -> each image's new tokens before its end."""
    core = model.core if core is None else core
    B, px = feats.shape[0], model.pixels(feats)
    options = dict(max_new_tokens=max_new, do_sample=False, num_beams=1,
                   suppress_tokens=model.suppressed.nonzero()[:, 0].tolist())
    with torch.no_grad():
        if arch in ("blip", "ved"):  # (their generate puts the start token first by itself)
            out = core.generate(pixel_values=px, **options)[:, 1:]
        else:
            images = px[:, None] if arch == "idefics3" else px  # Idefics3: (B, images, 3, S, S)
            out = core.generate(input_ids=model.prompt(B), pixel_values=images, **options)
            out = out[:, model.prompt_ids.shape[1]:]
    ends = set(model.end_ids.tolist())
    return [row[:next((i for i, t in enumerate(row) if t in ends), len(row))] for row in out.tolist()]


def caption_inputs(tok: LMTokenizer) -> torch.Tensor:
    """(3, T+1): <start> words <end>, padded with <pad> to one length."""
    ids = [tok.encode(["a", "red", "circle"]), tok.encode(["one", "blue", "square", "in", "the", "middle"]),
           tok.encode(["the", "triangle"])]
    T = max(map(len, ids))
    return torch.tensor([i + [Vocab.pad] * (T - len(i)) for i in ids])


# ---- decoding is the model's own ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_steps_give_the_tokens_of_the_models_own_generate(arch, tiny_hf):
    model = model_of(tiny_hf[arch], arch)
    feats = feats_for(model)
    ours = [[i - 4 for i in c.ids] for c in greedy(model, feats, 8)]  # captionkit ids: the model's + 4
    assert ours == hf_generate(model, arch, feats, 8)
    assert any(ours)  # (a random model: the tokens are noise, but there are some)


def test_a_model_with_several_ends_ends_at_the_most_probable(tiny_hf, tmp_path):
    """A generation config that lists several end tokens (SmolVLM's lists more than one): <end>
    is the most probable of them, as generate() stops at any; training teaches the tokenizer's own."""
    from transformers import AutoTokenizer

    folder = tmp_path / "two_ends"
    shutil.copytree(tiny_hf["idefics3"], folder)
    tok = AutoTokenizer.from_pretrained(folder)
    im_end, own = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id  # <end_of_utterance>
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [im_end, own]}))
    model = model_of(str(folder), "idefics3")
    assert model.end_ids.tolist() == [im_end, own] and model.eos_id == own
    logits = torch.zeros(2, model.n_lm)
    logits[0, im_end], logits[1, own], logits[1, im_end] = 5.0, 4.0, 3.0
    logp = model.to_vocab(logits)
    assert logp.argmax(1).tolist() == [Vocab.end, Vocab.end]
    allowed = logits.masked_fill(model.suppressed, float("-inf")).log_softmax(1)  # the other specials masked
    torch.testing.assert_close(logp[:, Vocab.end], allowed[[0, 1], [im_end, own]])
    assert torch.isinf(logp[:, 4 + im_end]).all() and torch.isinf(logp[:, 4 + own]).all()  # never as words
    feats = feats_for(model)
    assert [[i - 4 for i in c.ids] for c in greedy(model, feats, 8)] == hf_generate(model, "idefics3", feats, 8)


@pytest.mark.parametrize("arch", ARCHS)
def test_teacher_forcing_gives_the_models_own_forward(arch, tiny_hf):
    """After the image and the prompt (for GIT: positions counted from the text's start; for
    Idefics3: the connector's output at the image tokens' places), the caption's logits are the
    model's own forward's over the whole sequence, without a cache."""
    model = model_of(tiny_hf[arch], arch)
    feats = feats_for(model)
    ids = caption_inputs(LMTokenizer.build(tiny_hf[arch]))[:, :-1]  # (B, T): <start> w_1 ..
    core, px, B = model.core, model.pixels(feats), feats.shape[0]
    n = model.prompt_ids.shape[1] - 1  # prompt tokens before <start>'s
    whole = torch.cat([model.prompt(B)[:, :-1], model.lm_ids(ids)], 1)
    with torch.no_grad():
        ours = model.lm_logits(feats, ids)  # (B, T, V)
        if arch == "blip":
            theirs = core(pixel_values=px, input_ids=whole).logits[:, n:]
        elif arch == "ved":
            theirs = core(pixel_values=px, decoder_input_ids=whole).logits[:, n:]
        elif arch == "git":
            theirs = core(input_ids=whole, pixel_values=px).logits[:, model.n_image + n:]
        else:
            theirs = core(input_ids=whole, pixel_values=px[:, None]).logits[:, n:]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_encoder_rows_become_the_processors_pixel_values(arch, tiny_hf, tmp_path):
    """A photo at the model's input size (nothing to resize): hf_pixels' rows, normalised by the
    family, are what the model's own image processor makes of it."""
    from transformers import AutoImageProcessor

    source = tiny_hf[arch]
    enc = create_encoder("hf_pixels", weights=source)
    model = model_of(source, arch)
    assert enc.dim == model.cfg.feat_dim and list(enc.grid()) == model.cfg.grid == [4, 4]
    shape_image(2, size=32).save(tmp_path / "p.png")
    photo = load_rgb(tmp_path / "p.png")
    with torch.no_grad():
        ours = model.pixels(enc(to_tensor(photo, enc.preprocess).unsqueeze(0)))  # (1, 3, 32, 32)
    theirs = AutoImageProcessor.from_pretrained(source)(images=[photo], return_tensors="pt")["pixel_values"]
    theirs = theirs.reshape(ours.shape)  # Idefics3's (1, 1, 3, 32, 32): one image of one photo
    torch.testing.assert_close(ours, theirs.float(), atol=1e-5, rtol=1e-5)


# ---- --model hf: --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_photos")
    for i in range(3):
        shape_image(i, size=80, jitter=i).save(folder / f"p{i}.jpg", quality=95)
    return folder


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("arch", ARCHS)
def test_caption_with_hf_writes_jsonl_and_resumes(arch, tiny_hf, photos, tmp_path, capsys):
    source = tiny_hf[arch]
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "c.jsonl"
    common = ["caption", "--model", f"hf:{source}", "--beam", "2", "--batch-size", "2", "--jsonl", str(out)]
    assert main([*common, str(photos / "p0.jpg"), str(tmp_path / "broken.jpg")]) == 1  # 1: an unreadable file
    first = read_jsonl(out)
    assert [r["image"] for r in first] == ["p0.jpg", "broken.jpg"]
    assert "caption" in first[0] and "cannot read image" in first[1]["error"]
    # resumed: the images already there are skipped, the new ones appended
    assert main([*common, str(photos / "p0.jpg"), str(tmp_path / "broken.jpg"), str(photos / "p1.jpg"),
                 str(photos / "p2.jpg")]) == 1
    records = read_jsonl(out)
    assert [r["image"] for r in records] == ["p0.jpg", "broken.jpg", "p1.jpg", "p2.jpg"] and records[:2] == first
    # the same captions as the Python API's, and the same model recorded for the resume
    cap = Captioner.load(f"hf:{source}", device="cpu")
    direct = cap([str(photos / f"p{i}.jpg") for i in range(3)], beam=2)
    assert [r.text for r in direct] == [records[0]["caption"], *(r["caption"] for r in records[2:])]
    assert cap.config["family"] == FAMILY[arch] and cap.config["encoder"]["name"] == "hf_pixels"
    # another model for the same file is refused, not mixed in
    capsys.readouterr()
    other = next(tiny_hf[a] for a in ARCHS if a != arch)
    assert main(["caption", "--model", f"hf:{other}", "--jsonl", str(out), str(photos / "p0.jpg")]) == 2
    assert "model" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ARCHS)
def test_evaluate_scores_an_hf_model(arch, tiny_hf, flickr_dir, tmp_path):
    out = tmp_path / "eval.json"
    # a save_pretrained folder is taken as it is, without hf:
    assert main(["evaluate", "--model", tiny_hf[arch], "--dataset", str(flickr_dir), "--beam", "1",
                 "--metrics", "bleu,cider", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["model"] == f"hf:{Path(tiny_hf[arch]).resolve()}" and set(rep["captions"]) == {
        "img012.jpg", "img013.jpg", "img014.jpg"}
    assert {"Bleu_4", "CIDEr"} <= set(rep["scores"])


@pytest.mark.parametrize("arch", ARCHS)
def test_serve_captions_with_an_hf_model(arch, tiny_hf, photos):
    pytest.importorskip("fastapi")
    pytest.importorskip("multipart")
    from fastapi.testclient import TestClient

    from captionkit.serve import ServeConfig, create_app
    from captionkit.serve.app import load_models

    models = load_models([f"hf:{tiny_hf[arch]}"], device="cpu")
    (name, cap), = models.items()
    assert name == arch
    with TestClient(create_app(models, ServeConfig())) as client:
        r = client.post("/v1/caption", files={"image": ("p.jpg", (photos / "p1.jpg").read_bytes(), "image/jpeg")},
                        data={"beam": "2"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["caption"] == cap(str(photos / "p1.jpg"), beam=2).text
    assert body["grid"] == [4, 4] and len(body["attention"]) == len(body["words"])
    assert all(abs(sum(row) - 1) < 1e-3 for row in body["attention"])  # over the patch grid


def test_bf16_on_the_cpu_and_the_python_api(tiny_hf, photos):
    import captionkit

    cap = captionkit.load(f"hf:{tiny_hf['blip']}", device="cpu", precision="bf16")
    assert cap.precision == "bf16"
    result = cap(str(photos / "p0.jpg"), beam=2, attention=True)
    assert result.ok and result.attention.shape == (len(result.words), 16)


def test_an_instruction_tuned_model_gets_the_caption_template(tiny_hf):
    from transformers import AutoTokenizer

    from captionkit.inference.zero_shot import load_prompts

    source = tiny_hf["idefics3"]
    tok = AutoTokenizer.from_pretrained(source)
    template = load_prompts().get("caption")
    shown = tok.decode(Captioner.load(f"hf:{source}", device="cpu").decoder.prompt_ids[0])
    assert template in shown and shown.endswith("Assistant:") and shown.count("<image>") == 4
    mine = Captioner.load(f"hf:{source}", device="cpu", prompt=HF_PROMPT).decoder.prompt_ids[0]
    assert HF_PROMPT in tok.decode(mine) and template not in tok.decode(mine)
    # the models that need no instruction get none: BLIP's caption starts right after [DEC]
    assert Captioner.load(f"hf:{tiny_hf['blip']}", device="cpu").decoder.prompt_ids.tolist() == [
        [AutoTokenizer.from_pretrained(tiny_hf["blip"]).convert_tokens_to_ids("[DEC]")]]


# ---- fine-tuning -------------------------------------------------------------------------------------
EXPECTED_GROUPS = {  # training -> the groups that train, for a model with a connector (GIT, VED, Idefics3)
    "full": {"encoder", "connector", "decoder"}, "decoder": {"connector", "decoder"}, "lora": {"lora"}}


@pytest.mark.parametrize("training", list(EXPECTED_GROUPS))
@pytest.mark.parametrize("arch", ARCHS)
def test_a_training_step_trains_exactly_the_chosen_side(arch, training, tiny_hf):
    model = model_of(tiny_hf[arch], arch, training).train()
    feats = feats_for(model, 2)
    ids = caption_inputs(LMTokenizer.build(tiny_hf[arch]))[:2]
    loss, _ = model.training_loss(feats, ids[:, :-1], ids[:, 1:])
    loss.backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    learning = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert learning <= trained and set(model.state_dict()) == trained == model.trained  # checkpoints hold them
    # DDP's condition, family by family in one process: every trained parameter gets a gradient
    # (a zero one counts: LoRA's A while its B is still 0); one that gets none stops a DDP run at
    # its second step (tests/test_ddp_hf.py runs two families in two processes)
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trained
    expected = EXPECTED_GROUPS[training] - (set() if model.connector_prefixes else {"connector"})
    assert {model.groups[n] for n in learning} == expected == set(model.param_groups())
    if training == "lora":  # adapters on the language side only
        inner = [n.removeprefix("hf.base_model.model.") for n in trained]
        assert all("lora_" in n and n.startswith(model.language_prefixes) for n in inner)


def test_a_vision_pooler_never_trains_and_checkpoints_that_hold_it_still_load(tiny_hf):
    """A VisionEncoderDecoderModel loads its ViT with a pooler the caption never reads: frozen
    even in full fine-tuning (under DDP a trained parameter without a gradient stops the run:
    test_ddp_hf.py), and a full checkpoint written when it trained, holding it, loads."""
    model = model_of(tiny_hf["ved"], "ved", "full")
    pooler = {n: p.detach().clone() for n, p in model.named_parameters() if ".pooler." in n}
    assert pooler and not any(p.requires_grad for n, p in model.named_parameters() if n in pooler)
    assert not set(pooler) & model.trained and set(model.state_dict()) == model.trained
    model.load_state_dict({**model.state_dict(), **pooler})  # (strict: the rest must be exactly the trained)


def run_config(path: Path, arch: str, source: str, flickr_dir: Path, training: str) -> Path:
    prompt = f'prompt = "{prompt_of(arch)}"\n' if prompt_of(arch) else ""
    return write_lm_config(path, flickr_dir, f'name = "hf_pixels"\nweights = "{source}"',
                           f'family = "{FAMILY[arch]}"\nsource = "{source}"\ntraining = "{training}"\n{prompt}'
                           f'lora_rank = 2\nlora_dropout = 0.0', epochs=1,
                           train="train_max_images = 6\nval_max_images = 2")


def checkpoint_greedy(checkpoint: Path, feats: torch.Tensor) -> list[list[int]]:
    cap = Captioner.load(checkpoint, with_encoder=False, device="cpu")
    return [[i - 4 for i in c.ids] for c in greedy(cap.decoder, feats, 8)]


def assert_export_captions_as_the_checkpoint(checkpoint: Path, arch: str, out: Path, photos: Path) -> None:
    """export hf of ``checkpoint``: transformers' from_pretrained of the model's class loads it and
    its generate gives the checkpoint's greedy tokens; ``--model hf:OUT`` the checkpoint's captions."""
    import transformers

    from captionkit.export.exporters import export_transformers

    folder = export_transformers(checkpoint, out)
    loaded = getattr(transformers, CLASS[arch]).from_pretrained(folder).eval()
    model = Captioner.load(checkpoint, with_encoder=False, device="cpu").decoder
    feats = feats_for(model)
    assert hf_generate(model, arch, feats, 8, core=loaded) == checkpoint_greedy(checkpoint, feats)
    kept = json.loads((folder / PROMPT_FILE).read_text())  # what hf: reads back
    assert kept["prompt"] == prompt_of(arch) and kept["decoding"] == read_config(checkpoint)["decoding"]
    files = [str(photos / f"p{i}.jpg") for i in range(3)]
    # in float32: LoRA merged into the weights moves them by rounding, which bf16 (the CPU's "auto"
    # where it multiplies bf16) can turn into another beam of these random models' near-equal words
    exported, trained = (Captioner.load(m, device="cpu", precision="fp32")(files, beam=2)
                         for m in (f"hf:{folder}", checkpoint))
    assert [r.text for r in exported] == [r.text for r in trained]


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_fine_tuning_resumes_exactly_and_exports(arch, tiny_hf, flickr_dir, photos, tmp_path):
    cfg = run_config(tmp_path / "lora.toml", arch, tiny_hf[arch], flickr_dir, "lora")
    broken, whole = tmp_path / "broken", tmp_path / "whole"
    train(cfg, out=broken, max_steps=2, progress=False)
    assert read_config(broken / "last")["state"]["step"] == 2
    train(cfg, out=broken, max_steps=4, resume=True, progress=False)
    train(cfg, out=whole, max_steps=4, progress=False)
    a, b = read_weights(broken / "last"), read_weights(whole / "last")
    assert set(a) == set(b) and a and all("lora_" in k for k in a)  # the adapters alone are saved
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    config = read_config(whole / "last")
    assert config["family"] == FAMILY[arch] and config["model"]["source"] == tiny_hf[arch]
    assert config["encoder"]["name"] == "hf_pixels" and config["vocab"]["kind"] == "lm"
    assert_export_captions_as_the_checkpoint(whole / "last", arch, tmp_path / "exported", photos)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_fine_tuning_trains_both_sides_and_exports(arch, tiny_hf, flickr_dir, photos, tmp_path):
    cfg = run_config(tmp_path / "full.toml", arch, tiny_hf[arch], flickr_dir, "full")
    train(cfg, out=tmp_path / "run", max_steps=2, progress=False)
    saved = read_weights(tmp_path / "run" / "last")
    source = model_of(tiny_hf[arch], arch, "full").state_dict()
    assert set(saved) == set(source)  # every tensor of the model trained and saved ...
    changed = {k for k in saved if not torch.equal(saved[k], source[k])}
    vision = model_of(tiny_hf[arch], arch).vision_prefixes
    assert any(k.removeprefix("hf.").startswith(vision) for k in changed)  # ... the vision tower's too
    assert any(not k.removeprefix("hf.").startswith(vision) for k in changed)
    assert_export_captions_as_the_checkpoint(tmp_path / "run" / "last", arch, tmp_path / "exported", photos)


# ---- refusals ----------------------------------------------------------------------------------------
def test_models_that_are_not_there_or_not_captioners_are_one_line_errors(tiny_hf, tiny_lm, photos, tmp_path,
                                                                         capsys):
    from captionkit.core.errors import UserError

    def refused(args: list[str], message: str) -> None:
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err

    photo = str(photos / "p0.jpg")
    refused(["caption", "--model", f"hf:{tmp_path / 'nothing'}", photo], "no such model folder")
    refused(["caption", "--model", "hf:", photo], "hf: names no model")
    refused(["caption", "--model", f"hf:{tiny_lm}", photo], "is a llama model; captionkit captions with blip")
    refused(["caption", "--model", f"hf:{tiny_hf['blip']}", "--model", f"hf:{tiny_hf['git']}", photo],
            "captions alone, not as an ensemble's member")
    with pytest.raises(UserError, match="the hf_idefics3 family needs a prompt"):
        create_model("hf_idefics3", reference_config(tiny_hf["idefics3"]))
    with pytest.raises(UserError, match="is a git model; the hf_blip family takes blip models"):
        create_model("hf_blip", reference_config(tiny_hf["git"]))
    with pytest.raises(UserError, match="takes 4x4 patches of 3x8x8 pixels: use \\[encoder\\] name = \"hf_pixels\""):
        create_model("hf_blip", {**reference_config(tiny_hf["blip"]), "grid": [7, 7]})
    with pytest.raises(UserError, match="encoder hf_pixels needs weights"):
        create_encoder("hf_pixels")
    with pytest.raises(ValueError, match="training must be one of"):
        create_model("hf_blip", {**reference_config(tiny_hf["blip"]), "training": "some"})
    with pytest.raises(UserError, match="no layer named nothing_here for LoRA"):
        create_model("hf_blip", {**reference_config(tiny_hf["blip"]), "training": "lora",
                                 "lora_targets": ["nothing_here"]})


def test_an_hf_model_as_an_ensemble_member_is_one_line_saying_why(tiny_hf, tiny_run, photos, tmp_path, capsys):
    """An ensemble combines its members' next-word log-probabilities id by id over one tokenizer,
    from one encoder's rows; an hf model has its own of both. Named beside a captionkit member on
    the command line, by `captionkit ensemble`, or in an ensemble.json (as hf:, as "hf", or as the
    path of a save_pretrained folder), it is refused with one line that says so."""
    why = "over one tokenizer's words, read from one encoder's image rows, and a Hugging Face model has"

    def refused(args: list[str], *message: str) -> None:
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert all(m in err for m in (why, *message)) and len(err.splitlines()) == 1, err

    photo, member = str(photos / "p0.jpg"), str(tiny_run / "best")
    refused(["caption", "--model", member, "--model", f"hf:{tiny_hf['blip']}", photo], "captions alone")
    refused(["ensemble", "--model", member, "--model", f"hf:{tiny_hf['blip']}", "--out", str(tmp_path / "e")])
    assert not (tmp_path / "e").exists()
    local = tmp_path / "blip"
    shutil.copytree(tiny_hf["blip"], local)
    for k, entry in enumerate([{"path": f"hf:{tiny_hf['blip']}"}, {"hf": "Salesforce/blip-image-captioning-base"},
                               {"path": "../blip"}]):
        folder = tmp_path / f"ens{k}"
        folder.mkdir()
        members = [{"path": os.path.relpath(member, folder), "weight": 1}, {**entry, "weight": 1}]
        (folder / "ensemble.json").write_text(json.dumps({"format": "captionkit-ensemble", "version": 1,
                                                          "members": members}))
        shown = "members[1] names a Hugging Face model" if k < 2 else f"named in {folder / 'ensemble.json'}"
        refused(["caption", "--model", str(folder), photo], shown)


def test_a_frozen_run_is_refused_before_any_work(tiny_hf, flickr_dir, tmp_path, no_expensive_work):
    from captionkit.core.errors import UserError

    cfg = run_config(tmp_path / "frozen.toml", "blip", tiny_hf["blip"], flickr_dir, "frozen")
    with pytest.raises(UserError, match="frozen.toml: model.training = \"frozen\" trains nothing of the hf_blip"):
        train(cfg, out=tmp_path / "run", max_steps=1, progress=False)


@pytest.mark.slow  # a local Ray
def test_engine_ray_captions_an_hf_model_as_the_local_engine(tiny_hf, photos, tmp_path):
    with local_ray():
        common = ["caption", str(photos), "--model", f"hf:{tiny_hf['git']}", "--beam", "2", "--batch-size", "2"]
        assert main([*common, "--jsonl", str(tmp_path / "local.jsonl")]) == 0
        assert main([*common, "--jsonl", str(tmp_path / "ray.jsonl"), "--engine", "ray", "--shard-size", "2"]) == 0
        assert (tmp_path / "ray.jsonl").read_text() == (tmp_path / "local.jsonl").read_text()


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_on_a_gpu_greedy_gives_the_cpus_tokens(arch, tiny_hf):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    model = model_of(tiny_hf[arch], arch)
    feats = feats_for(model)
    cpu = [c.ids for c in greedy(model, feats, 8)]
    torch.backends.cuda.matmul.allow_tf32 = False
    model.to("cuda")
    assert [c.ids for c in greedy(model, feats.cuda(), 8)] == cpu
    cap = Captioner(model, LMTokenizer.build(tiny_hf[arch]), {
        "encoder": {"grid": model.cfg.grid}}).place("cuda", "bf16")
    assert len(cap.decode_features(feats, beam=2)) == 3  # bf16 autocast on the GPU runs



@pytest.mark.cuda
@pytest.mark.parametrize("training", ["lora", "full"])
@pytest.mark.parametrize("arch", ["blip", "idefics3"])
def test_on_a_gpu_fine_tuning_steps_as_on_the_cpu(arch, training, tiny_hf, flickr_dir, tmp_path, monkeypatch):
    """Three fine-tuning steps of a tiny model on the GPU, in float32 (the config's) with TF32 off,
    give the CPU's weights, and the checkpoint loads on the CPU. Compared tensor by tensor in norm.
    On an H200 the attention keys' biases differed by up to 3e-4 an element: see below."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    import contextlib

    from captionkit.core import precision

    monkeypatch.setattr(precision, "tf32_matmuls", contextlib.nullcontext)  # fp32's TF32 region
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    cfg = run_config(tmp_path / "ft.toml", arch, tiny_hf[arch], flickr_dir, training)
    for device in ("cpu", "cuda"):
        train(cfg, out=tmp_path / device, max_steps=3, progress=False, device=device)
    a, b = read_weights(tmp_path / "cpu" / "last"), read_weights(tmp_path / "cuda" / "last")
    assert set(a) == set(b) and a
    assert all(t.device.type == "cpu" for t in b.values())
    # An attention key's bias has gradient 0 in exact arithmetic (the softmax ignores a shift of
    # every score), so its float noise, which Adam scales up to lr, is all these steps give it
    noise = [k for k in a if k.endswith(("key.bias", "k_proj.bias"))]
    compared = [k for k in a if k not in noise]
    assert len(compared) > len(noise)
    for k in compared:  # at helpers.LM_CONFIG's lr 3e-3, 3 steps move these by about their own size
        assert (b[k].float() - a[k].float()).norm() <= 1e-2 * a[k].float().norm() + 1e-6, k
    Captioner.load(tmp_path / "cuda" / "last", with_encoder=False, device="cpu")
