"""The attention figure's layout, measured on the PNG it writes: each panel's word sits with its
own photo, clearly apart from the photo above it (issue 29, item 16: second-row titles touched
the photos above)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

from captionkit.inference.figures import save_attention_figure

WORDS = "a man in a red shirt is standing in front of a group of people".split()  # 15 panels: 4 rows


def row_runs(png) -> list[tuple[str, int]]:
    """The PNG's pixel rows top to bottom as runs of P (a photo: a run of ink over 100 px wide),
    T (text: ink, no such run) and . (blank), each with its height in pixels."""
    ink = np.asarray(Image.open(png).convert("L")) < 245
    kinds = []
    for row in ink:
        edges = np.flatnonzero(np.diff(np.concatenate(([0], row.astype(np.int8), [0]))))
        longest = int((edges[1::2] - edges[0::2]).max()) if len(edges) else 0
        kinds.append("P" if longest > 100 else "T" if row.any() else ".")
    return [(m.group()[0], m.end() - m.start()) for m in re.finditer(r"P+|T+|\.+", "".join(kinds))]


@pytest.mark.parametrize("size", [(224, 224), (224, 168), (168, 224)], ids=["square", "landscape", "portrait"])
def test_each_title_sits_with_its_photo_not_on_the_one_above(size, tmp_path):
    attention = torch.softmax(torch.randn(len(WORDS), 81, generator=torch.Generator().manual_seed(0)), -1)
    out = save_attention_figure(Image.new("RGB", size, (90, 120, 60)), WORDS, attention, (9, 9), tmp_path / "f.png")
    runs = row_runs(out)
    kinds = "".join(k for k, _ in runs)
    assert kinds == ".T.T.P.T.P.T.P.T.P.", kinds  # caption, then 4 rows of titled panels
    heights = [h for _, h in runs]
    caption_gap, own_gaps = heights[2], heights[4:-1:4]  # caption to the first titles; title to its photo
    above_gaps = heights[6:-1:4]  # a photo to the title of the panel below it
    assert caption_gap >= 4, runs
    assert min(above_gaps) >= 8 and min(above_gaps) >= 2 * max(own_gaps), runs
