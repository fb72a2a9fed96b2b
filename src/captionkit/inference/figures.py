"""Per-word attention figures (paper section 5.4): each word's weights over the grid,
upsampled to the photo, Gaussian-smoothed and laid over it, the word as the panel's title."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..core.outputs import atomic_write_bytes


def attention_overlay(alpha: np.ndarray, size: tuple[int, int], sigma_cells: float = 0.5) -> np.ndarray:
    """(H, W) grid weights -> (h, w) map in [0, 1] over a photo of ``size`` = (w, h)."""
    from scipy.ndimage import gaussian_filter

    gh, gw = alpha.shape
    img_w, img_h = size
    up = np.asarray(Image.fromarray(alpha.astype(np.float32), mode="F").resize((img_w, img_h), Image.Resampling.BICUBIC))
    up = gaussian_filter(up, sigma=sigma_cells * img_h / gh)
    up = up - up.min()
    return up / up.max() if up.max() > 0 else up


def attention_figure(photo: Image.Image, words: list[str], attention: torch.Tensor, grid: tuple[int, int],
                     columns: int = 5):
    """A matplotlib Figure: the photo, then one panel per word with its attention over the photo
    (``attention``: (len(words), H * W) over a ``grid`` of (H, W))."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    photo = photo.convert("RGB")
    scale = 224 / max(photo.size)
    photo = photo.resize((max(1, round(photo.width * scale)), max(1, round(photo.height * scale))))
    img = np.asarray(photo)
    panels = len(words) + 1
    cols = min(columns, panels)
    rows = math.ceil(panels / cols)
    # 2.8 in a row (2.6 before): with 2.6, tight_layout left a panel's title 2-3 px under the
    # photo above it at 80 dpi (and the caption 1 px over the first titles); 2.8 leaves about
    # 17 px, against the 4 px between a title and its own photo, so each word reads with its panel
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    axes.flat[0].imshow(img)
    axes.flat[0].set_title("photo", fontsize=11)
    att = attention.float().numpy().reshape(len(words), *grid)  # (n, H, W)
    for i, word in enumerate(words):
        ax = axes.flat[i + 1]
        weight = attention_overlay(att[i], photo.size)[..., None]  # (h, w, 1) in [0, 1]
        ax.imshow((img * (0.15 + 0.85 * weight)).astype(np.uint8))  # dark where it did not look
        ax.set_title(word, fontsize=11)
    fig.suptitle(" ".join(words), fontsize=12)
    fig.tight_layout()
    return fig


def save_attention_figure(photo: Image.Image, words: list[str], attention: torch.Tensor,
                          grid: tuple[int, int], out: str | Path, columns: int = 5) -> Path:
    """Write a PNG grid: the photo, then one panel per word with its attention over the photo."""
    import matplotlib.pyplot as plt

    fig = attention_figure(photo, words, attention, grid, columns)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return atomic_write_bytes(Path(out), buf.getvalue())  # a killed run leaves no half figure
