"""Zero-shot captions from an instruction-tuned vision-language model (VLM) through
``transformers``: Qwen2.5-VL-7B-Instruct by default, or any model that
``AutoModelForImageTextToText`` loads (a Hub name or a folder) whose processor has a chat
template (for Qwen2.5-VL that class resolves to ``Qwen2_5_VLForConditionalGeneration``).

A caption is the model's answer to a prompt template, a named instruction read from a TOML
file (:func:`load_prompts`; the shipped ``captionkit/inference/vlm_prompts.toml`` holds three for recipe
titles), decoded greedily and cleaned of chat boilerplate by :func:`clean_answer`.

``transformers`` is an optional dependency (``pip install 'captionkit[vlm]'``); it, torch and
Pillow are imported inside functions only, so this module is cheap to import. Weights come
from a folder or the Hugging Face cache; the Hub is asked only when ``download`` is set (a 7B
model is 16 GB), and where the weights are absent the error names the model.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import ImageError, UserError, WeightsUnavailable
from ..core.hf import require_transformers

if TYPE_CHECKING:
    import torch

DEFAULT_VLM = "Qwen/Qwen2.5-VL-7B-Instruct"
DEFAULT_PROMPTS = Path(__file__).with_name("vlm_prompts.toml")
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class Prompts:
    """Named prompt templates from a TOML file: ``[templates.NAME]`` tables with a ``text``,
    and an optional top-level ``default`` naming the template used when none is asked for."""

    path: Path
    templates: dict[str, str]
    default: str

    def get(self, name: str | None = None) -> str:
        name = name or self.default
        if name not in self.templates:
            raise UserError(f"{self.path}: no template {name!r} (it has: {', '.join(self.templates)})")
        return self.templates[name]


def load_prompts(path: str | Path | None = None) -> Prompts:
    """Read a prompt-template file (the shipped one when ``path`` is None)."""
    path = Path(path) if path else DEFAULT_PROMPTS
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such prompt file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: invalid TOML ({e})") from None
    unknown = sorted(set(doc) - {"default", "templates"})
    if unknown:
        raise UserError(f"{path}: unknown field(s) {', '.join(unknown)} (expected default and [templates.NAME])")
    tables = doc.get("templates")
    if not isinstance(tables, dict) or not tables:
        raise UserError(f"{path}: no [templates.NAME] tables")
    templates = {}
    for name, table in tables.items():
        text = table.get("text") if isinstance(table, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{path}: templates.{name} needs a non-empty text")
        extra = sorted(set(table) - {"text"})
        if extra:
            raise UserError(f"{path}: unknown field(s) in templates.{name}: {', '.join(extra)}")
        templates[name] = text.strip()
    default = doc.get("default", next(iter(templates)))
    if default not in templates:
        raise UserError(f"{path}: default names {default!r}, which is not a template")
    return Prompts(path, templates, default)


# special tokens left in decoded text (<|im_end|>, <s>, [INST], <end_of_turn>)
_SPECIAL = re.compile(r"<\|[^|<>]*\|>|</?s>|\[/?INST\]|<(?:start|end)_of_turn>")
# a chat turn's role alone on a line: what remains of a decoded conversation without its tags
_ROLE_LINE = re.compile(r"(system|user|assistant|model)", re.IGNORECASE)
# an answer's turn marker within a line ("USER: <image> ... ASSISTANT: answer")
_INLINE_TURN = re.compile(r"\b(?:assistant|gpt)\s*:", re.IGNORECASE)
_PREFIXES = [
    re.compile(r"^(?:sure|certainly|okay|ok)[!,.]+\s*", re.IGNORECASE),  # chatty openers ("Sure! ...")
    re.compile(r"^here(?:'s| is) (?:a|an|the|my|one)\b[^:]*:\s*", re.IGNORECASE),  # "Here's a title for it: ..."
    # labels: "Title:", "Recipe title:", "Short phrase:", "Answer:"
    re.compile(r"^(?:[a-z]+\s+){0,2}(?:title|caption|name|phrase|answer|description)\s*:\s*", re.IGNORECASE),
    re.compile(r"^(?:[#>*•]+|[-–]\s)\s*"),  # markdown headings, quotes and bullets
]
_QUOTES = {'"': '"', "'": "'", "\u201c": "\u201d", "\u2018": "\u2019", "\u00ab": "\u00bb", "`": "`"}


def _clean_line(line: str) -> str:
    line = "".join(ch for ch in line if ch.isprintable() or ch.isspace())  # no control characters
    text = " ".join(line.replace("**", "").replace("__", "").split())
    while True:
        before = text
        for pattern in _PREFIXES:
            text = pattern.sub("", text)
        if len(text) >= 2 and _QUOTES.get(text[0]) == text[-1]:  # surrounding quotes only
            text = text[1:-1].strip()
        if text.endswith(".") and not text.endswith(".."):  # titles end without a full stop
            text = text[:-1].rstrip()
        if text == before:
            return text


def clean_answer(text: str) -> str:
    """A model's answer as a caption: special tokens dropped, and everything up to the last
    assistant turn when a whole conversation was decoded (a role alone on a line, or
    "ASSISTANT:"); then the first line left once chatty openers ("Sure! Here is a title:"),
    labels ("Title:"), markdown, surrounding quotes and a final full stop are stripped.
    "" when nothing is left."""
    text = _SPECIAL.sub("\n", text)
    turns = list(_INLINE_TURN.finditer(text))
    if turns:
        text = text[turns[-1].end():]
    lines = text.splitlines()
    turns = [i for i, ln in enumerate(lines) if _ROLE_LINE.fullmatch(ln.strip())]
    if turns:
        lines = lines[turns[-1] + 1:]
    for line in lines:
        cleaned = _clean_line(line)
        if cleaned:
            return cleaned
    return ""


@dataclass
class Answer:
    text: str  # the caption: the cleaned answer
    raw: str  # the answer as decoded


def _transformers():
    return require_transformers("zero-shot captioning", "vlm", quiet=False)


class ZeroShotCaptioner:
    """A VLM and its processor; :meth:`answer` captions PIL images with one prompt."""

    def __init__(self, model, processor):
        self.model, self.processor = model, processor
        # batched generation appends to every row at the same position: pad on the left
        self.processor.tokenizer.padding_side = "left"

    @classmethod
    def load(cls, model: str = DEFAULT_VLM, download: bool = False, dtype: str = "auto",
             device: str | torch.device = "auto") -> ZeroShotCaptioner:
        """``model``: a folder or a Hub name (looked up in the Hugging Face cache, and on the
        Hub when ``download``). ``dtype``: "auto" keeps the checkpoint's (bfloat16 for
        Qwen2.5-VL: 16 GB for the 7B model, where float32 would need 30 GB). ``device``: as
        ``--device`` takes it (captionkit.core.devices; "auto": a GPU when there is one), or a
        torch.device; checked before the weights load."""
        from ..core.devices import resolve_device

        if dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        where = resolve_device(device) if isinstance(device, str) else device
        tf = _transformers()
        import torch

        folder = Path(model).expanduser()
        source = str(folder) if folder.is_dir() else model
        local_only = folder.is_dir() or not download
        try:
            processor = tf.AutoProcessor.from_pretrained(source, local_files_only=local_only)
            vlm = tf.AutoModelForImageTextToText.from_pretrained(
                source, local_files_only=local_only, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
        except OSError as e:
            if folder.is_dir():
                raise WeightsUnavailable(f"{model}: not a complete model folder ({str(e).splitlines()[0]})") from None
            if not download:
                raise WeightsUnavailable(f"{model}: no such model folder, and its weights are not in the Hugging Face "
                                         "cache (--download fetches them from the Hub)") from None
            raise WeightsUnavailable(f"{model}: weights could not be downloaded ({str(e).splitlines()[0]})") from None
        except ValueError as e:  # e.g. a text-only model: no image-text-to-text class for its config
            raise UserError(f"{model}: not a vision-language model transformers can caption with "
                             f"({str(e).splitlines()[0]})") from None
        if not getattr(processor, "chat_template", None):
            raise UserError(f"{model}: its processor has no chat template (not an instruction-tuned model?)")
        return cls(vlm.to(where).eval(), processor)

    def answer(self, images: list, prompt: str, max_new_tokens: int = 32) -> list[Answer]:
        """One greedy answer per PIL image to the same prompt (one user turn: image, then text)."""
        import torch

        chats = [[{"role": "user", "content": [{"type": "image", "image": im}, {"type": "text", "text": prompt}]}]
                 for im in images]
        inputs = self.processor.apply_chat_template(
            chats, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
            processor_kwargs={"padding": True}).to(self.model.device)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        raw = self.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        return [Answer(clean_answer(r), r) for r in raw]

    def caption_files(self, paths: list[Path], prompt: str, batch_size: int = 4,
                      max_new_tokens: int = 32) -> Iterator[tuple[Path, Answer | ImageError]]:
        """(path, answer) in the order given; an image that cannot be read or that the model's
        processor refuses gets an ImageError naming the file instead, and the rest go on."""
        from ..data.images import load_rgb

        for i in range(0, len(paths), batch_size):
            loaded: list[tuple[Path, object]] = []
            for path in paths[i:i + batch_size]:
                try:
                    loaded.append((path, load_rgb(path)))
                except ImageError as e:
                    loaded.append((path, e))
            good = [(p, im) for p, im in loaded if not isinstance(im, ImageError)]
            answers = dict(zip([p for p, _ in good], self._answer_each(good, prompt, max_new_tokens)))
            for path, im in loaded:
                yield path, im if isinstance(im, ImageError) else answers[path]

    def _answer_each(self, good: list[tuple[Path, object]], prompt: str, max_new_tokens: int):
        """Answers for a batch; when the processor refuses one image (e.g. an extreme aspect
        ratio), the batch is redone one image at a time so only that one fails."""
        if not good:
            return []
        try:
            return self.answer([im for _, im in good], prompt, max_new_tokens)
        except ValueError as e:
            if len(good) == 1:
                return [ImageError(f"{good[0][0]}: the model's processor refused it ({str(e).splitlines()[0]})")]
            return [a for item in good for a in self._answer_each([item], prompt, max_new_tokens)]
