"""What ``captionkit score`` and ``captionkit evaluate`` accept as captions and references,
checked before anything is scored. A wrong shape is one line naming the file and the image,
never a silent score (a reference given as a plain string would otherwise be scored letter by
letter, and an image given twice would keep its last caption).

- Captions: ``{"image": "caption", ...}``, or coco-caption's results list
  ``[{"image_id": ..., "caption": "..."}, ...]`` (an ``image_id`` may be a number; it is then
  matched with the references as text).
  ``score --captions`` also takes a list of captions for an image (an n-best list, samples:
  :func:`check_caption_sets`), scoring its first and measuring the diversity of all of them.
- References: ``{"image": ["reference", ...], ...}``, each list holding at least one string.
- Files are UTF-8 JSON (a byte-order mark is allowed); an image named twice is an error.

Light on imports on purpose: ``captionkit score`` uses it without torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import DatasetError


class _Pairs(list):
    """A JSON object as its (key, value) pairs, in order, so that repeated keys can be named."""


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (_Pairs, dict)):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "an object"


def read_json(path: str | Path, what: str) -> Any:
    """The JSON document in ``path``, its objects as :class:`_Pairs`; one-line errors that name
    the file for a missing file, bytes that are not UTF-8, and JSON that does not parse."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such {what} file") from None
    except IsADirectoryError:
        raise DatasetError(f"{path}: is a folder, not a {what} file") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read the {what} file ({e.strerror})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                           f"save the {what} as UTF-8") from None
    try:
        return json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise DatasetError(f"{path}: invalid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer too long to convert
        raise DatasetError(f"{path}: invalid JSON ({e})") from None


def _object_items(obj: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(obj, _Pairs):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.items())
    return None


def _unique(items: list[tuple[Any, Any]], source: str) -> dict:
    out: dict = {}
    for key, value in items:
        if key in out:
            raise DatasetError(f"{source}: image {key!r} is given twice")
        out[key] = value
    return out


def check_captions(obj: Any, source: str) -> dict[str, str]:
    """``obj`` (parsed JSON or a dict) as {image: caption}, or a one-line error naming ``source``
    and the image."""
    items = _object_items(obj)
    if items is None:
        if not isinstance(obj, list):
            raise DatasetError(f"{source}: expected {{image: caption}} or a list of "
                               f"{{\"image_id\": ..., \"caption\": ...}} objects, not {_kind(obj)}")
        items = _results_list(obj, source)
    captions = _unique(items, source)
    if not captions:
        raise DatasetError(f"{source}: no captions")
    for image, caption in captions.items():
        if not isinstance(caption, str):
            raise DatasetError(f"{source}: image {image!r}: the caption is {_kind(caption)}, not a string")
    return captions


def _results_list(obj: list, source: str) -> list[tuple[str, Any]]:
    """coco-caption's results format: [{"image_id": ..., "caption": ...}, ...] -> pairs."""
    pairs = []
    for i, item in enumerate(obj):
        fields = _object_items(item)
        if fields is None:
            raise DatasetError(f"{source}: item {i} is {_kind(item)}; a list of captions holds "
                               f"{{\"image_id\": ..., \"caption\": ...}} objects (or give {{image: caption}})")
        fields_d = dict(fields)
        if "image_id" not in fields_d or "caption" not in fields_d:
            raise DatasetError(f"{source}: item {i} needs an \"image_id\" and a \"caption\"")
        image = fields_d["image_id"]
        if isinstance(image, bool) or not isinstance(image, (str, int)):
            raise DatasetError(f"{source}: item {i}: the image_id is {_kind(image)}, not a name or a number")
        pairs.append((str(image), fields_d["caption"]))
    return pairs


def check_caption_sets(obj: Any, source: str) -> dict[str, list[str]]:
    """As :func:`check_captions`, and an image's caption may also be a list of captions (an
    n-best list or samples, as ``captionkit caption --num-captions`` writes them):
    {image: [caption, ...]}, each list holding at least one string."""
    items = _object_items(obj)
    if items is None:
        return {k: [v] for k, v in check_captions(obj, source).items()}
    sets = _unique(items, source)
    if not sets:
        raise DatasetError(f"{source}: no captions")
    out = {}
    for image, value in sets.items():
        if isinstance(value, list) and not isinstance(value, _Pairs):
            if not value:
                raise DatasetError(f"{source}: image {image!r}: no captions (an empty list)")
            for j, text in enumerate(value):
                if not isinstance(text, str):
                    raise DatasetError(f"{source}: image {image!r}: caption {j} is {_kind(text)}, not a string")
            out[image] = list(value)
        elif isinstance(value, str):
            out[image] = [value]
        else:
            raise DatasetError(f"{source}: image {image!r}: the caption is {_kind(value)}, not a string")
    return out


def check_references(obj: Any, source: str) -> dict[str, list[str]]:
    """``obj`` (parsed JSON or a dict) as {image: [reference, ...]}, or a one-line error naming
    ``source`` and the image."""
    items = _object_items(obj)
    if items is None:
        raise DatasetError(f"{source}: expected {{image: [reference, ...]}}, not {_kind(obj)}")
    refs = _unique(items, source)
    if not refs:
        raise DatasetError(f"{source}: no references")
    for image, texts in refs.items():
        if isinstance(texts, str):
            raise DatasetError(f"{source}: image {image!r}: the references are one string, not a list "
                               f"of strings (write [\"...\"])")
        if not isinstance(texts, list) or isinstance(texts, _Pairs):
            raise DatasetError(f"{source}: image {image!r}: the references are {_kind(texts)}, "
                               f"not a list of strings")
        if not texts:
            raise DatasetError(f"{source}: image {image!r}: no references (an empty list)")
        for j, text in enumerate(texts):
            if not isinstance(text, str):
                raise DatasetError(f"{source}: image {image!r}: reference {j} is {_kind(text)}, not a string")
    return refs


def read_captions(path: str | Path) -> dict[str, str]:
    return check_captions(read_json(path, "captions"), str(path))


def read_caption_sets(path: str | Path) -> dict[str, list[str]]:
    return check_caption_sets(read_json(path, "captions"), str(path))


def read_references(path: str | Path) -> dict[str, list[str]]:
    return check_references(read_json(path, "references"), str(path))
