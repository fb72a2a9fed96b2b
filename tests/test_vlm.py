"""Zero-shot VLM captioning on a tiny random Qwen2.5-VL built from a config object, with an
offline byte-level BPE tokenizer holding the chat and vision special tokens: no download."""

import json
from pathlib import Path

import pytest
from helpers import cli_captions, shape_image

from captionkit.cli.main import main
from captionkit.core.errors import ImageError, WeightsUnavailable
from captionkit.inference.zero_shot import DEFAULT_PROMPTS, DEFAULT_VLM, ZeroShotCaptioner, clean_answer, load_prompts

transformers = pytest.importorskip("transformers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat layout, reduced to what captioning sends: text and image parts of each turn
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = list(load_prompts().templates.values()) + ["system user assistant Lemon Chicken Pie"]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  chat_template=CHAT_TEMPLATE)
    ids = dict(zip(SPECIAL, tok.convert_tokens_to_ids(SPECIAL)))
    # 56x56 pixels: 4x4 patches of 14, merged 2x2 into 4 image tokens
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56),
                                    tokenizer=tok, video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                           window_size=56, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_vlm")
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dishes")
    for k in range(3):
        shape_image(k, size=64).save(d / f"dish{k}.jpg")
    return d


def test_the_tiny_vlm_captions_with_each_shipped_template(tiny_vlm, photos, monkeypatch):
    cap = ZeroShotCaptioner.load(str(tiny_vlm))
    assert type(cap.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    sent = []
    generate = cap.model.generate

    def spy(**inputs):  # what reached the model: the chat template's input ids
        sent.append(cap.processor.batch_decode(inputs["input_ids"], skip_special_tokens=False))
        return generate(**inputs)

    monkeypatch.setattr(cap.model, "generate", spy)
    prompts = load_prompts()
    assert set(prompts.templates) == {"ingredients", "title", "descriptive", "caption"}
    files = sorted(photos.iterdir())
    for name, text in prompts.templates.items():
        sent.clear()
        results = list(cap.caption_files(files, text, batch_size=2, max_new_tokens=6))
        assert [p for p, _ in results] == files
        for _, answer in results:
            assert isinstance(answer.text, str) and answer.text.strip(), (name, answer.raw)
            assert answer.text == clean_answer(answer.raw)
        assert len(sent) == 2  # batches of 2 and 1
        for row in sent[0] + sent[1]:
            assert text in row and "<|image_pad|>" in row and row.rstrip().endswith("<|im_start|>assistant")


def test_zero_shot_command_writes_caption_json_and_goes_on_past_bad_images(tiny_vlm, photos, tmp_path, capsys):
    bad = tmp_path / "in"
    bad.mkdir()
    for f in photos.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "broken.jpg").write_text("not a photo")
    mine = tmp_path / "mine.toml"
    mine.write_text('[templates.colour]\ntext = "What colour is the shape?"\n')
    out = tmp_path / "caps.json"
    code = main(["zero-shot", str(bad), "--model", str(tiny_vlm), "--prompts", str(mine), "--json", str(out),
                 "--max-new-tokens", "5"])
    got = capsys.readouterr()
    assert code == 1 and "broken.jpg" in got.err and "1 of 4 images could not be captioned" in got.err
    caps = json.loads(out.read_text())
    assert sorted(caps) == ["dish0.jpg", "dish1.jpg", "dish2.jpg"]  # the shape `captionkit score` reads
    assert all(isinstance(c, str) for c in caps.values())
    assert code == 1 and got.out.count("\t") == 3


def test_zero_shot_shares_caption_s_resumable_outputs(tiny_vlm, photos, tmp_path, capsys):
    """zero-shot writes through the same writer as caption: --jsonl resumes, and only with the
    same model, prompt and answer length."""
    out = tmp_path / "caps.jsonl"
    args = ["zero-shot", str(photos), "--model", str(tiny_vlm), "--jsonl", str(out), "--max-new-tokens", "4"]
    assert main(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["image"] for r in recs) == ["dish0.jpg", "dish1.jpg", "dish2.jpg"]
    assert json.loads((tmp_path / "caps.jsonl.meta.json").read_text())["settings"]["prompt"] == load_prompts().get()
    assert main(args) == 0 and "3 already done" in capsys.readouterr().err
    assert main(args[:-1] + ["5"]) == 2
    assert "was written with --max-new-tokens 4, this run has --max-new-tokens 5" in capsys.readouterr().err
    assert main(args + ["--template", "ingredients"]) == 2
    assert "was written with the prompt (--prompts/--template)" in capsys.readouterr().err


def test_zero_shot_template_prompts_and_answer_length_reach_the_model(tiny_vlm, photos, tmp_path):
    """--template and --prompts choose the question the model is asked, --max-new-tokens the
    answer's length: the command's answers are the library's to that question and length, and
    they differ from one question (or length) to another. (The tiny model answers the shipped
    title and ingredients questions alike: both end in "... only."; descriptive does not.)"""
    cap = ZeroShotCaptioner.load(str(tiny_vlm))
    files = sorted(photos.iterdir())
    mine = tmp_path / "mine.toml"
    mine.write_text('[templates.colour]\ntext = "What colour is the shape?"\n')

    def direct(prompt: str, tokens: int = 5) -> dict[str, str]:
        return {p.name: r.text for p, r in cap.caption_files(files, prompt, max_new_tokens=tokens)}

    prompts = load_prompts()
    assert prompts.default == "title"
    want = {"title": direct(prompts.get("title")), "descriptive": direct(prompts.get("descriptive")),
            "colour": direct("What colour is the shape?"), "title, 2 tokens": direct(prompts.get("title"), 2)}
    assert len({json.dumps(w, sort_keys=True) for w in want.values()}) == len(want)
    base = ["zero-shot", str(photos), "--model", str(tiny_vlm)]
    for argv, name in ((["--max-new-tokens", "5"], "title"),
                       (["--template", "descriptive", "--max-new-tokens", "5"], "descriptive"),
                       (["--prompts", str(mine), "--max-new-tokens", "5"], "colour"),
                       (["--max-new-tokens", "2"], "title, 2 tokens")):
        assert cli_captions(tmp_path, base + argv) == want[name], name


def test_missing_weights_get_one_line_naming_the_model(tmp_path, capsys):
    from huggingface_hub import try_to_load_from_cache
    with pytest.raises(WeightsUnavailable, match=r"^nobody/no-such-vlm: no such model folder, and its weights are "
                                                 r"not in the Hugging Face cache"):
        ZeroShotCaptioner.load("nobody/no-such-vlm")
    if isinstance(try_to_load_from_cache(DEFAULT_VLM, "config.json"), str):
        pytest.skip(f"{DEFAULT_VLM} is in this machine's Hugging Face cache")
    shape_image(0).save(tmp_path / "photo.jpg")
    assert main(["zero-shot", str(tmp_path)]) == 2  # the default model, not downloaded here
    err = capsys.readouterr().err
    assert err.startswith(f"captionkit zero-shot: error: {DEFAULT_VLM}: no such model folder") and err.count("\n") == 1


def test_prompt_files_are_checked_and_name_the_field(tmp_path):
    assert load_prompts(DEFAULT_PROMPTS).get() == load_prompts().templates["title"]
    bad = tmp_path / "p.toml"
    bad.write_text('[templates.a]\ntext = ""\n')
    with pytest.raises(ValueError, match=r"p.toml: templates.a needs a non-empty text"):
        load_prompts(bad)
    bad.write_text('default = "b"\n[templates.a]\ntext = "x"\n')
    with pytest.raises(ValueError, match=r"p.toml: default names 'b', which is not a template"):
        load_prompts(bad)
    bad.write_text('[templates.a]\ntext = "x"\nprompt = "y"\n')
    with pytest.raises(ValueError, match=r"unknown field\(s\) in templates.a: prompt"):
        load_prompts(bad)
    bad.write_text('[templates.a]\ntext = "x"\n')
    with pytest.raises(ValueError, match=r"p.toml: no template 'zz' \(it has: a\)"):
        load_prompts(bad).get("zz")


@pytest.mark.parametrize("raw,want", [
    ("Lemon-Garlic Roast Chicken", "Lemon-Garlic Roast Chicken"),
    ('"Spicy Pork Tacos".', "Spicy Pork Tacos"),
    ("Title: \u201cBrown-Butter Pecan Pie\u201d", "Brown-Butter Pecan Pie"),
    ("**Recipe Title:** Miso-Glazed Salmon\n\nThis dish pairs salmon with a sweet glaze.", "Miso-Glazed Salmon"),
    ('Sure! Here is a title for this recipe:\n\n"Crispy Smashed Potatoes"', "Crispy Smashed Potatoes"),
    ("system\nYou are a helpful assistant.\nuser\nWhat is the title?\nassistant\nBeef Stew with Carrots.",
     "Beef Stew with Carrots"),
    ("<|im_start|>assistant\nChocolate Cake<|im_end|>", "Chocolate Cake"),
    ("USER: <image>\nName the dish. ASSISTANT: A bowl of ramen", "A bowl of ramen"),
    ("ASSISTANT: 'Roast chicken with lemon and thyme'", "Roast chicken with lemon and thyme"),
    ("model\n## Apple Crumble", "Apple Crumble"),
    ("Mom's 'Best' Pie", "Mom's 'Best' Pie"),  # inner quotes and apostrophes stay
    ("OK Corral Chili", "OK Corral Chili"),
    ("   \n ", ""),
])
def test_clean_answer_strips_chat_boilerplate(raw, want):
    assert clean_answer(raw) == want


def test_an_image_the_processor_refuses_fails_alone(tiny_vlm, photos, monkeypatch):
    cap = ZeroShotCaptioner.load(str(tiny_vlm))
    answer = cap.answer

    def picky(images, prompt, max_new_tokens=32):
        if any(im.size == (64, 64) and im.getpixel((32, 32))[2] > 200 for im in images):  # the blue square
            raise ValueError("absurd aspect ratio")
        return answer(images, prompt, max_new_tokens)

    monkeypatch.setattr(cap, "answer", picky)
    results = dict(cap.caption_files(sorted(photos.iterdir()), "Name it.", batch_size=3, max_new_tokens=3))
    assert isinstance(results[photos / "dish1.jpg"], ImageError)
    assert "dish1.jpg: the model's processor refused it (absurd aspect ratio)" in str(results[photos / "dish1.jpg"])
    assert not isinstance(results[photos / "dish0.jpg"], ImageError)
