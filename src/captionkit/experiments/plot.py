"""Training curves of runs and sweeps: ``captionkit plot RUN_OR_SWEEP... --out curves.png``.

One panel per metric (the training ``loss``, the dev ``val_loss``, dev scores x100, ``lr``, ...),
one line per run, x = captions seen (or epochs); the legend names what differs between the runs'
configs. :func:`curve_series` gives the plotted numbers (``--data`` writes them as JSON), so what
is drawn can be checked without looking at pixels.
"""

from __future__ import annotations

import io
import math

from ..core.errors import UserError
from ..scoring.evaluation import METRICS
from .runs import Run, seen

XS = ("captions", "epochs")
_TITLES = {"loss": "training loss", "val_loss": "dev loss (teacher-forced)", "lr": "learning rate"}


def default_metrics(runs: list[Run]) -> list[str]:
    """loss, val_loss and the runs' selection metrics (train.val_metric)."""
    chosen = [r.config.get("train", {}).get("val_metric", "CIDEr") for r in runs]
    return ["loss", "val_loss", *dict.fromkeys(chosen)]


def counts_captions(run: Run) -> bool:
    """Whether the run's history counts what each epoch trained on (older runs' does not)."""
    return any("captions" in e or "images" in e for e in run.history)


def curve_series(runs: list[Run], metrics: list[str], x: str = "captions") -> dict:
    """{"x": ..., "panels": [{"metric", "title", "lines": [{"label", "run", "x": [...], "y": [...]}]}]}:
    every run's values of each metric at the epochs that recorded it (scores x100). x: captions
    seen so far (images for self-critical runs), or the epoch."""
    if x not in XS:
        raise UserError(f"--x must be one of {', '.join(XS)}, not {x!r}")
    uncounted = [r for r in runs if x == "captions" and not counts_captions(r)]
    if uncounted:
        raise UserError(f"{uncounted[0].path}: its history.jsonl does not count the captions seen "
                         f"(written by an older captionkit); plot it with --x epochs")
    panels = []
    for metric in metrics:
        lines = []
        for r in runs:
            xs, ys, total = [], [], 0
            for entry in r.history:
                total += seen(entry)
                value = entry.get(metric)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    xs.append(total if x == "captions" else entry["epoch"])
                    ys.append(100 * value if metric in METRICS else value)
            if xs:
                lines.append({"label": r.label, "run": str(r.path), "x": xs, "y": ys})
        if not lines:
            recorded = sorted({k for r in runs for e in r.history for k, v in e.items()
                               if isinstance(v, (int, float)) and k not in ("epoch", "step")})
            raise UserError(f"no run recorded {metric!r} (they recorded: {', '.join(recorded)})")
        title = _TITLES.get(metric, f"dev {metric} (x100)" if metric in METRICS else metric)
        panels.append({"metric": metric, "title": title, "lines": lines})
    return {"x": x, "panels": panels}


def draw_curves(series: dict, columns: int = 3) -> bytes:
    """The panels of :func:`curve_series` as a PNG: the same colour for a run in every panel,
    one legend below them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = series["panels"]
    cols = min(columns, len(panels))
    rows = math.ceil(len(panels) / cols)
    labels = list(dict.fromkeys(line["label"] for p in panels for line in p["lines"]))
    colours = {lab: plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")(i % 20) for i, lab in enumerate(labels)}
    legend_rows = math.ceil(len(labels) / 2)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows + 0.3 * legend_rows + 0.4),
                             squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    xlabel = "captions seen" if series["x"] == "captions" else "epoch"
    for ax, panel in zip(axes.flat, panels):
        for line in panel["lines"]:
            ax.plot(line["x"], line["y"], marker="o", markersize=3, linewidth=1.5, color=colours[line["label"]])
        ax.set_title(panel["title"], fontsize=11)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if panel["metric"] == "lr":
            ax.set_yscale("log")
    handles = [plt.Line2D([], [], color=colours[lab], marker="o", markersize=4) for lab in labels]
    fig.legend(handles, labels, loc="lower center", ncol=min(2, len(labels)), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, (0.3 * legend_rows + 0.2) / fig.get_figheight(), 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
