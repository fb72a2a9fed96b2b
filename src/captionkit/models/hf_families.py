"""The Hugging Face captioner families (what they share: :mod:`.hf_captioner`), in two kinds:

- a decoder with cross-attention to the image states: ``hf_blip`` (BlipForConditionalGeneration:
  a ViT and a BERT decoder) and ``hf_ved`` (any VisionEncoderDecoderModel: ViT + GPT-2 such as
  nlpconnect/vit-gpt2-image-captioning, or other pairs whose decoder takes cross-attention).
  ``prepare`` runs the vision tower and the prompt through the decoder once: the memory is the
  image states, every layer's cross-attention keys/values of them and the prompt's own keys/values
  (its last token left out: <start> feeds it again).
- a decoder-only model whose sequence is the image tokens and then the text: ``hf_git``
  (GitForCausalLM: the image tokens attend to each other both ways, the text causally) and
  ``hf_idefics3`` (Idefics3 and SmolVLM: a SigLIP-style tower, a pixel-shuffle connector, a LLaMA
  language model after a chat prompt). ``prepare`` runs image and prompt once; the memory is the
  keys/values of all of it but the prompt's last token.

Every step then feeds one token with a KV cache built from the state and the memory as they are
(:func:`captionkit.core.hf.kv_cache`: not copied).
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.errors import UserError
from ..core.hf import kv_cache, load_pretrained, with_cache
from ..core.hf_image_text import WHAT, hf_transformers
from .base import KVMemory
from .hf_captioner import CrossMemory, HFCaptioner, grid_attention, hf_family, token_ids


def _pairs(layers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in layers]


def _flat(layers) -> tuple[torch.Tensor, ...]:
    """A cache's layers as a decoding state: (keys_0, values_0, keys_1, ...)."""
    return tuple(t for layer in layers for t in (layer.keys, layer.values))


def _text_ids(tok, prompt: str) -> list[int]:
    return tok.encode(prompt, add_special_tokens=False) if prompt.strip() else []


# ---- a decoder with cross-attention ----------------------------------------------------------------
class CrossAttentionCaptioner(HFCaptioner):
    def decoder(self) -> nn.Module:
        """The language side: a causal LM that takes encoder_hidden_states."""
        raise NotImplementedError

    def image_states(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised pixels (B, 3, S, S) -> the states the decoder attends to (B, L, D)."""
        raise NotImplementedError

    def prepare(self, feats: torch.Tensor) -> CrossMemory:
        """(B, H*W, 3*p*p) -> the image states, each layer's cross-attention keys/values of them and
        the prompt's self-attention keys/values before its last token."""
        from transformers import DynamicCache, EncoderDecoderCache

        hidden = self.image_states(self.pixels(feats))  # (B, L, D)
        prompt = self.prompt(hidden.shape[0])  # (B, n)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self.decoder()(input_ids=prompt, encoder_hidden_states=hidden, logits_to_keep=1, **with_cache(cache))
        n = prompt.shape[1] - 1
        own = cache.self_attention_cache.layers
        cross = cache.cross_attention_cache.layers
        return CrossMemory(hidden, [c.keys for c in cross], [c.values for c in cross],
                           [c.keys[:, :, :n] for c in own], [c.values[:, :, :n] for c in own])

    def _run(self, ids: torch.Tensor, state, mem: CrossMemory, attention: bool):
        from transformers import EncoderDecoderCache

        # the cross-attention half non-empty: the decoder takes its keys/values instead of
        # computing them again from the image states
        cache = EncoderDecoderCache(kv_cache(zip(state[0::2], state[1::2])), kv_cache(zip(mem.keys, mem.values)))
        out = self.decoder()(input_ids=ids, encoder_hidden_states=mem.hidden, output_attentions=attention,
                             **with_cache(cache))
        att = None
        if attention:  # per layer (B, heads, T, L): the last position over the image states
            att = grid_attention(torch.stack([a[:, :, -1] for a in out.cross_attentions]).float().mean((0, 2)),
                                 self.cfg.grid)
        return out.logits, _flat(cache.self_attention_cache.layers), att


@hf_family("hf_blip")
class BlipCaptioner(CrossAttentionCaptioner):
    """BlipForConditionalGeneration (Salesforce/blip-image-captioning-base, -large): a caption starts
    after [DEC] (text_config.bos_token_id) and the prompt's tokens, and ends with [SEP]."""

    model_types = ("blip",)
    model_class = "BlipForConditionalGeneration"
    vision_prefixes = ("vision_model.",)
    language_prefixes = ("text_decoder.",)

    def setup(self, model, tok):
        text = model.config.text_config
        return [text.bos_token_id, *_text_ids(tok, self.cfg.prompt)], token_ids(text.sep_token_id)

    @staticmethod
    def output_layer(model) -> nn.Module:
        return model.text_decoder.get_output_embeddings()

    def decoder(self) -> nn.Module:
        return self.core.text_decoder

    def image_states(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.core.vision_model(pixel_values=pixels).last_hidden_state


@hf_family("hf_ved")
class VisionEncoderDecoderCaptioner(CrossAttentionCaptioner):
    """A VisionEncoderDecoderModel (nlpconnect/vit-gpt2-image-captioning, or a ``vit_gpt2``
    export): a caption starts after ``decoder_start_token_id`` and the prompt's tokens and ends
    with the generation config's end. (The ``vit_gpt2`` family builds a new one from a ViT and a
    GPT-2; this one captions with, and fine-tunes, a model that exists.)"""

    model_types = ("vision-encoder-decoder",)
    model_class = "VisionEncoderDecoderModel"
    vision_prefixes = ("encoder.",)
    connector_prefixes = ("enc_to_dec_proj.",)
    language_prefixes = ("decoder.",)

    def setup(self, model, tok):
        gen, config = model.generation_config, model.config
        start = token_ids(gen.decoder_start_token_id, config.decoder_start_token_id)[:1]
        ends = token_ids(gen.eos_token_id, config.eos_token_id, config.decoder.eos_token_id)
        return ([*start, *_text_ids(tok, self.cfg.prompt)] if start else []), ends

    def decoder(self) -> nn.Module:
        return self.core.decoder

    def image_states(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.core.encoder(pixel_values=pixels).last_hidden_state  # (B, L, D_encoder)
        if hasattr(self.core, "enc_to_dec_proj"):  # the model has it exactly when its forward uses it
            hidden = self.core.enc_to_dec_proj(hidden)
        return hidden


# ---- a decoder-only model: image tokens, then the text ---------------------------------------------
class PrefixCaptioner(HFCaptioner):
    """The family's ``setup`` registers the buffer ``image_positions``: where in the sequence the
    image tokens are (what a step's attention is read over)."""

    def prefix_cache(self, pixels: torch.Tensor):
        """Normalised pixels (B, 3, S, S) -> the DynamicCache of the image tokens and the whole prompt."""
        raise NotImplementedError

    def prepare(self, feats: torch.Tensor) -> KVMemory:
        """(B, H*W, 3*p*p) -> the keys/values of the image tokens and the prompt but its last token."""
        layers = self.prefix_cache(self.pixels(feats)).layers
        n = layers[0].keys.shape[2] - 1
        return KVMemory([c.keys[:, :, :n] for c in layers], [c.values[:, :, :n] for c in layers])

    def forward_text(self, ids: torch.Tensor, cache, attention: bool):
        """The model's forward over text ids after a cache -> its output (logits, attentions)."""
        return self.core(input_ids=ids, output_attentions=attention, **with_cache(cache))

    def _run(self, ids: torch.Tensor, state, mem: KVMemory, attention: bool):
        cache = kv_cache(zip(state[0::2], state[1::2]))
        out = self.forward_text(ids, cache, attention)
        att = None
        if attention:  # per layer (B, heads, T, S): the last position over the image tokens
            att = torch.stack([a[:, :, -1].index_select(2, self.image_positions) for a in out.attentions])
            att = grid_attention(att.float().mean((0, 2)), self.cfg.grid)
        return out.logits, _flat(cache.layers), att


# GIT's text steps after a cache (masks, positions) changed inside transformers 5.x: on 5.17
# captionkit's steps no longer gave generate()'s tokens (measured on 2026-11-26; 5.24 is what the
# tests pass on). Versions between were not tried.
GIT_MIN_TRANSFORMERS = (5, 24)


def check_git_transformers() -> None:
    import transformers

    have = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if have < GIT_MIN_TRANSFORMERS:
        raise UserError(f"hf_git needs transformers >= {'.'.join(map(str, GIT_MIN_TRANSFORMERS))} "
                        f"(this environment has {transformers.__version__}): pip install -U transformers")


@hf_family("hf_git")
class GitCaptioner(PrefixCaptioner):
    """GitForCausalLM (microsoft/git-base-coco, ...): the image tokens (CLIP's, projected), then a
    caption after [CLS] (bos_token_id) and the prompt's tokens, ending with [SEP] (eos_token_id).
    The text's positions count from its first token, not from the image tokens before it."""

    model_types = ("git",)
    model_class = "GitForCausalLM"
    vision_prefixes = ("git.image_encoder.",)
    connector_prefixes = ("git.visual_projection.",)
    language_prefixes = ("git.encoder.", "git.embeddings.", "output.")

    def setup(self, model, tok):
        check_git_transformers()
        if model.config.num_image_with_embedding:
            raise UserError(f"{self.cfg.source!r} is a GIT model of {model.config.num_image_with_embedding} "
                             f"frames (video); captionkit captions photos")
        self.n_image = model.git.encoder.layer[0].attention.self.image_patch_tokens  # class token + patches
        self.register_buffer("image_positions", torch.arange(self.n_image), persistent=False)
        ends = token_ids(model.generation_config.eos_token_id, model.config.eos_token_id)
        return [model.config.bos_token_id, *_text_ids(tok, self.cfg.prompt)], ends

    def prefix_cache(self, pixels: torch.Tensor):
        from transformers import DynamicCache

        cache = DynamicCache()
        self.core.git(input_ids=self.prompt(pixels.shape[0]), pixel_values=pixels, **with_cache(cache))
        return cache

    def forward_text(self, ids: torch.Tensor, cache, attention: bool):
        # GIT numbers a text position from the cache's length, which counts the image tokens:
        # its own positions (a view of the model's position table) say where the text is
        start = cache.get_seq_length() - self.n_image
        positions = self.core.git.embeddings.position_ids[:, start:start + ids.shape[1]]  # (1, T)
        return self.core(input_ids=ids, position_ids=positions, output_attentions=attention, **with_cache(cache))


@hf_family("hf_idefics3")
class Idefics3Captioner(PrefixCaptioner):
    """Idefics3 and SmolVLM (HuggingFaceTB/SmolVLM-256M-Instruct, ...) through
    AutoModelForImageTextToText: the processor's chat template builds the prompt -- one user turn of
    the image and ``prompt`` (the instruction, which this family needs), then "Assistant:" -- with
    the image's tokens as the processor expands them for one image at the vision side's size (no
    splitting into tiles); a caption is the answer, ending with the generation config's end
    (<end_of_utterance>). The image tokens are the connector's output at their places."""

    model_types = ("idefics3", "smolvlm")
    model_class = "AutoModelForImageTextToText"
    vision_prefixes = ("model.vision_model.",)
    connector_prefixes = ("model.connector.",)
    language_prefixes = ("model.text_model.", "lm_head.")
    needs_prompt = True

    def setup(self, model, tok):
        if not self.cfg.prompt.strip():
            raise UserError(f"the {self.family} family needs a prompt, the instruction a caption answers "
                             f"([model] prompt; --model hf: takes the caption template of vlm_prompts.toml)")
        from PIL import Image

        processor = load_pretrained(hf_transformers().AutoProcessor, self.cfg.source, WHAT)
        if not getattr(processor, "chat_template", None):
            raise UserError(f"{self.cfg.source!r}: its processor has no chat template")
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.cfg.prompt}]}]
        text = processor.apply_chat_template(turn, add_generation_prompt=True)
        size = self.cfg.grid[0] * self.patch
        # one image of the vision side's size, not split into tiles: its tokens, as the processor writes them
        ids = processor(text=[text], images=[[Image.new("RGB", (size, size))]], do_image_splitting=False,
                        return_tensors="pt")["input_ids"][0]
        image_token = model.config.image_token_id
        positions = (ids == image_token).nonzero()[:, 0]
        per_image = model.config.vision_config.image_size // self.patch // model.config.scale_factor
        if len(positions) != per_image ** 2:
            raise UserError(f"{self.cfg.source!r}: its processor writes {len(positions)} image tokens for a "
                             f"{size} px photo, its model makes {per_image ** 2}")
        self.register_buffer("image_positions", positions, persistent=False)
        return ids.tolist(), token_ids(model.generation_config.eos_token_id, model.config.text_config.eos_token_id)

    def prefix_cache(self, pixels: torch.Tensor):
        from transformers import DynamicCache

        inner = self.core.model
        B, S = pixels.shape[0], pixels.shape[-1]
        # the vision tower's forward, step by step: a photo of the tower's size has no padded patches,
        # so its attention needs no mask -- what the tower's own forward finds only by reading the
        # all-true patch mask on the host (a sync per batch)
        tower = inner.vision_model
        patches = pixels.new_ones(B, S // self.patch, S // self.patch, dtype=torch.bool)  # (B, h, w)
        hidden = tower.embeddings(pixel_values=pixels, patch_attention_mask=patches)
        vision = tower.post_layernorm(tower.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state)
        image = inner.connector(vision)  # (B, image tokens, D)
        embeds = inner.text_model.get_input_embeddings()(self.prompt(B))  # (B, n, D)
        embeds = embeds.index_copy(1, self.image_positions, image.to(embeds.dtype))
        cache = DynamicCache()
        inner.text_model(inputs_embeds=embeds, **with_cache(cache))
        return cache
