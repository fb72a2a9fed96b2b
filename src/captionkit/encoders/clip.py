"""CLIP's image tower (Radford et al. 2021) through the ``open_clip`` package, as a grid
encoder: the vision transformer's patch tokens after its last layer (and final LayerNorm),
without the class token, e.g. 7x7 x 768 for ViT-B/32 at 224 px.

``open_clip`` is an optional dependency (``pip install 'captionkit[clip]'``), imported only
when a CLIP encoder is built. Pretrained weights are open_clip's: taken from the Hugging Face
cache when present, else downloaded by open_clip; where neither works (no network) the error
names the model and the file to fetch. ``weights="random"`` builds the architecture untrained
(tests), a path loads that file (an open_clip state dict, ``.safetensors`` or ``.bin``/``.pt``).
Photos are resized to the tower's square input size (not centre-cropped: see Preprocess).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..core.errors import UserError
from .base import Encoder, Preprocess, WeightsUnavailable, load_state_file, register_encoder

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _open_clip():
    try:
        import open_clip
    except ImportError as e:
        raise WeightsUnavailable("CLIP encoders need the 'open_clip_torch' package "
                                 "(pip install 'captionkit[clip]' or pip install open_clip_torch)") from e
    return open_clip


class CLIPGrid(Encoder):
    def __init__(self, visual: nn.Module, mean=CLIP_MEAN, std=CLIP_STD):
        super().__init__()
        visual.output_tokens = True  # forward returns (pooled, patch tokens)
        self.visual = visual
        size = visual.image_size[0] if isinstance(visual.image_size, tuple) else int(visual.image_size)
        self.side = size // (visual.patch_size[0] if isinstance(visual.patch_size, tuple) else int(visual.patch_size))
        self.dim = int(visual.transformer.width)
        self.preprocess = Preprocess(size=size, mean=tuple(mean), std=tuple(std))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        _, tokens = self.visual(x.contiguous())  # (B, L, D), class token left out
        B, L, D = tokens.shape
        return tokens.transpose(1, 2).reshape(B, D, self.side, self.side)  # (B, D, H, W)


_HF_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")


def _cached_file(hf_hub: str) -> Path | None:
    """open_clip's weights file for a Hugging Face entry ("org/name/" or "org/name/file") if it
    is in the local Hugging Face cache; never touches the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    parts = hf_hub.split("/")
    repo, name = "/".join(parts[:2]), "/".join(parts[2:])
    for filename in ([name] if name else _HF_FILES):
        hit = try_to_load_from_cache(repo, filename)
        if isinstance(hit, str):
            return Path(hit)
    return None


def _weights_file(open_clip, model: str, tag: str | None) -> Path:
    """The pretrained weights of (model, tag): the Hugging Face cache, else a download."""
    if not tag:
        raise WeightsUnavailable(f"open_clip model {model!r}: no pretrained tag given; pass a weights file")
    cfg = open_clip.pretrained.get_pretrained_cfg(model, tag)
    if not cfg:
        raise WeightsUnavailable(f"open_clip has no pretrained weights {tag!r} for {model!r}")
    cached = _cached_file(cfg["hf_hub"]) if cfg.get("hf_hub") else None
    if cached:
        return cached
    try:
        return Path(open_clip.pretrained.download_pretrained(cfg))
    except Exception as e:  # no network, proxy, disk...
        raise WeightsUnavailable(
            f"CLIP {model} ({tag}): open_clip's weights are not in the Hugging Face cache and could not "
            f"be downloaded ({type(e).__name__}); fetch {cfg.get('hf_hub') or cfg.get('url')} on a machine "
            f"with network, or pass a weights file; weights='random' only for tests") from None


def create_clip_encoder(model: str, tag: str | None = None, weights: str | None = None) -> Encoder:
    """CLIP's image tower of open_clip's ``model`` (e.g. "ViT-B-32") with the weights of its
    pretrained ``tag`` (e.g. "openai"), a file, or "random"."""
    open_clip = _open_clip()
    model_cfg = open_clip.get_model_config(model)
    if not model_cfg:
        raise UserError(f"open_clip knows no model {model!r}")
    if "timm_model_name" in model_cfg["vision_cfg"] or "layers" not in model_cfg["vision_cfg"] \
            or isinstance(model_cfg["vision_cfg"]["layers"], (list, tuple)):
        raise UserError(f"open_clip model {model!r}: only its own vision transformers give a grid of patch tokens")
    path = None
    if weights != "random":
        path = Path(weights) if weights else _weights_file(open_clip, model, tag)
        if not path.is_file():
            raise WeightsUnavailable(f"{path}: weights file not found")
    pcfg = open_clip.pretrained.get_pretrained_cfg(model, tag) if tag else {}
    # the image tower alone: the text tower would double the build time for nothing
    visual = open_clip.model._build_vision_tower(
        model_cfg["embed_dim"], model_cfg["vision_cfg"],
        quick_gelu=bool(pcfg.get("quick_gelu") or model_cfg.get("quick_gelu")))
    if path is None:
        weights_id = "random"
    else:
        try:
            sd = load_state_file(str(path))
        except Exception as e:  # e.g. OpenAI's TorchScript archives, which are not state dicts
            raise UserError(f"{path}: not an open_clip state dict ({type(e).__name__})") from None
        sd = {k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")}
        try:
            visual.load_state_dict(sd)
        except RuntimeError as e:
            raise UserError(f"{path}: not {model} weights ({str(e).splitlines()[0]})") from None
        weights_id = f"{tag}:{path.name}" if tag and not weights else path.name
    enc = CLIPGrid(visual, pcfg.get("mean", CLIP_MEAN), pcfg.get("std", CLIP_STD))
    enc.weights_id = weights_id
    return enc


@register_encoder("clip_vit_b32")
def clip_vit_b32(weights: str | None = None) -> Encoder:
    return create_clip_encoder("ViT-B-32", "openai", weights)


@register_encoder("clip_vit_b16")
def clip_vit_b16(weights: str | None = None) -> Encoder:
    return create_clip_encoder("ViT-B-16", "openai", weights)
