"""Tiny randomly initialised Hugging Face image-to-text captioners, written as ``save_pretrained``
writes them (model, tokenizer, image processor; no network): BLIP, GIT, a VisionEncoderDecoderModel
(ViT + GPT-2) and Idefics3 (the SmolVLM architecture, an ``AutoModelForImageTextToText`` model).
Width 32, 2 layers per side, 32 px images of 8 px patches: each builds and saves in well under
a second. The fixtures built from them live in conftest.py; test_hf_models.py, the model contract
tests and meta_models.py use them.

``initializer_range`` 0.2 on the language sides: at the usual 0.02 a width-32 model's logits are all
~0 and a random model's caption is a coin toss between the end and a word at every step."""

from __future__ import annotations

from pathlib import Path

from helpers import SHAPES, TEMPLATES, shapes_bpe

SIZE, PATCH = 32, 8  # every tiny model's image side and patch side: a 4 x 4 patch grid
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=SIZE,
              patch_size=PATCH)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)
# CLIP's normalisation, as BLIP's and GIT's processors have it (not 0.5: a test tells them apart)
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
ARCHITECTURES = ("blip", "git", "ved", "idefics3")

# the shapes captions' words, for the WordPiece vocabularies of BLIP and GIT
_WORDS = sorted({w for c, _, s in SHAPES for t in TEMPLATES for w in t.format(c=c, s=s).split()})
_LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]


def _wordpiece(folder: Path, specials: list[str]):
    """A BERT tokenizer (lower case) whose vocabulary is ``specials``, the shapes words, and every
    letter alone and as a continuation (so any lower-case word can be spelt)."""
    from transformers import BertTokenizerFast

    vocab = [*specials, *_WORDS, *(x for x in _LETTERS if x not in _WORDS), *(f"##{x}" for x in _LETTERS), "."]
    return BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True)


def write_tiny_blip(folder: Path) -> str:
    """BlipForConditionalGeneration and its BlipProcessor: [DEC] starts a caption, [SEP] ends it."""
    import torch
    from transformers import BlipConfig, BlipForConditionalGeneration, BlipImageProcessor, BlipProcessor

    tok = _wordpiece(folder, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]"])
    tok.add_special_tokens({"bos_token": "[DEC]"})
    ids = tok.convert_tokens_to_ids
    torch.manual_seed(0)
    config = BlipConfig(
        text_config=dict(TEXT, vocab_size=len(tok), encoder_hidden_size=32, bos_token_id=ids("[DEC]"),
                         sep_token_id=ids("[SEP]"), eos_token_id=ids("[SEP]"), pad_token_id=ids("[PAD]"),
                         initializer_range=0.2),
        vision_config=dict(VISION, initializer_range=0.02))
    BlipForConditionalGeneration(config).save_pretrained(folder)
    processor = BlipImageProcessor(size={"height": SIZE, "width": SIZE}, image_mean=CLIP_MEAN, image_std=CLIP_STD)
    BlipProcessor(image_processor=processor, tokenizer=tok).save_pretrained(folder)
    return str(folder)


def write_tiny_git(folder: Path) -> str:
    """GitForCausalLM and its GitProcessor (a CLIP image processor): [CLS] starts, [SEP] ends."""
    import torch
    from transformers import CLIPImageProcessor, GitConfig, GitForCausalLM, GitProcessor

    tok = _wordpiece(folder, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    ids = tok.convert_tokens_to_ids
    torch.manual_seed(0)
    config = GitConfig(vision_config=VISION, vocab_size=len(tok), **TEXT, bos_token_id=ids("[CLS]"),
                       eos_token_id=ids("[SEP]"), pad_token_id=ids("[PAD]"), initializer_range=0.2)
    GitForCausalLM(config).save_pretrained(folder)
    processor = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE},
                                   image_mean=CLIP_MEAN, image_std=CLIP_STD)
    GitProcessor(image_processor=processor, tokenizer=tok).save_pretrained(folder)
    return str(folder)


def write_tiny_ved(folder: Path) -> str:
    """A VisionEncoderDecoderModel of a ViT (width 24) and a GPT-2 (width 32, so the projection
    between them exists) with a byte-level BPE trained on the shapes captions; <|endoftext|>
    starts and ends a caption, as in nlpconnect/vit-gpt2-image-captioning."""
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast, ViTConfig, ViTImageProcessor,
                              ViTModel, VisionEncoderDecoderModel)

    tok = GPT2TokenizerFast(tokenizer_object=shapes_bpe(["<|endoftext|>"]), bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    eos = tok.eos_token_id
    torch.manual_seed(0)
    vit = ViTModel(ViTConfig(**dict(VISION, hidden_size=24, intermediate_size=48, num_attention_heads=2)),
                   add_pooling_layer=False)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=eos, eos_token_id=eos, add_cross_attention=True,
                                      is_decoder=True, initializer_range=0.2))
    model = VisionEncoderDecoderModel(encoder=vit, decoder=gpt2)
    model.config.decoder_start_token_id = model.config.pad_token_id = model.config.eos_token_id = eos
    model.generation_config.decoder_start_token_id = model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    ViTImageProcessor(size={"height": SIZE, "width": SIZE}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                      resample=3).save_pretrained(folder)
    return str(folder)


# SmolVLM's chat template (one user turn: the image, then the instruction; "Assistant:" after it)
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def write_tiny_idefics3(folder: Path) -> str:
    """Idefics3ForConditionalGeneration (SigLIP-style vision side, pixel-shuffle connector of scale
    2: 4 image tokens per image, LLaMA language side) and its Idefics3Processor with SmolVLM's chat
    template, without image splitting; <end_of_utterance> ends an answer."""
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, PreTrainedTokenizerFast)

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                "<end_of_utterance>", "<global-img>"]
    bpe = shapes_bpe(specials, ("User: Assistant: Describe this image briefly.",))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                  extra_special_tokens=["<fake_token_around_image>", "<image>",
                                                        "<end_of_utterance>", "<global-img>"])
    ids = tok.convert_tokens_to_ids
    torch.manual_seed(0)
    text = dict(TEXT, model_type="llama", vocab_size=len(tok), num_key_value_heads=2, bos_token_id=ids("<|im_start|>"),
                eos_token_id=ids("<end_of_utterance>"), pad_token_id=ids("<|endoftext|>"), initializer_range=0.2,
                tie_word_embeddings=False)
    config = Idefics3Config(vision_config=VISION, text_config=text, scale_factor=2, image_token_id=ids("<image>"),
                            tie_word_embeddings=False)
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids("<end_of_utterance>")
    model.generation_config.pad_token_id = ids("<|endoftext|>")
    model.save_pretrained(folder)
    processor = Idefics3ImageProcessor(size={"longest_edge": SIZE}, max_image_size={"longest_edge": SIZE},
                                       do_image_splitting=False, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    Idefics3Processor(image_processor=processor, tokenizer=tok, image_seq_len=4,
                      chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    return str(folder)


WRITERS = {"blip": write_tiny_blip, "git": write_tiny_git, "ved": write_tiny_ved, "idefics3": write_tiny_idefics3}


def write_tiny_hf_models(root: Path) -> dict[str, str]:
    """Each architecture's tiny model in its own folder under ``root``: {architecture: folder}."""
    return {name: write(root / name) for name, write in WRITERS.items()}
