"""A run report to share: ``captionkit report RUN_OR_SWEEP... --out report.html``.

One self-contained HTML file (inline CSS and script; photos as small base64 JPEG thumbnails and
the curves as a PNG, embedded): the runs and the settings that differ between them, each run's
scores on a split with bootstrap 95% intervals over images (captionkit.scoring.evaluation's scorers and
bootstrap, as ``captionkit score --bootstrap`` prints them), the training curves
(captionkit.experiments.plot), and a table of images with their references and every run's caption. Hovering
a word shows where the model looked for it, for models whose attention is not uniform.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..core.errors import UserError
from ..scoring.diversity import LABELS, Diversity, cell, diversity_rows, shown_fields
from ..scoring.evaluation import bootstrap, score_captions
from .plot import counts_captions, curve_series, default_metrics, draw_curves
from .runs import Run, best_entry, differing_settings, flatten, format_value, seen, trained_parameters


@dataclass
class RunResult:
    run: Run
    captions: dict[str, str]  # every image of the split
    shown: dict[str, dict] = field(default_factory=dict)  # the table's images: words, attention, grid
    scores: dict[str, float] = field(default_factory=dict)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    implementation: dict[str, str] = field(default_factory=dict)
    diversity: Diversity | None = None  # of the captions (captionkit.scoring.diversity)
    human: Diversity | None = None  # of the references of the same images: the human row


def _same_data(runs: list[Run]) -> dict:
    """The runs' shared [data] table (their dataset, image folder and CSV columns)."""
    from ..training.config import DataConfig

    # runs saved before a field existed have its declared default (dataset has none)
    defaults = {f.name: f.default for f in fields(DataConfig)}
    keys = ("dataset", "images", "image_column", "title_column", "image_suffix")
    first = {k: runs[0].config["data"].get(k, defaults[k]) for k in keys}
    for r in runs[1:]:
        other = {k: r.config["data"].get(k, defaults[k]) for k in keys}
        if other != first:
            k = next(k for k in keys if other[k] != first[k])
            raise UserError(f"{r.path}: trained with data.{k} = {other[k]!r}, {runs[0].path} with {first[k]!r}; "
                             f"a report compares runs on one dataset")
    return first


def _attention(result, keep: bool) -> dict:
    """A caption's words, and (when ``keep``) each word's attention over the grid, rounded."""
    out = {"words": result.words, "grid": list(result.grid)}
    if keep and len(result.words):
        att = result.attention.float()
        if float((att.max(1).values - att.min(1).values).max()) > 1e-6:  # uniform: nothing to show
            out["attention"] = [[round(float(a), 4) for a in row] for row in att]
    return out


def caption_split(run: Run, items, shown: set[str], beam: int, batch_size: int = 16) -> RunResult:
    """Caption every image of the split with the run's best checkpoint (its own length penalty)."""
    from ..core.errors import ImageError
    from ..core.progress import progress
    from ..inference.captioner import Captioner

    cap = Captioner.load(run.checkpoint, device="cpu")  # the report is made on the CPU, as before load() took "auto"
    res = RunResult(run, {})
    results = cap.caption_files([it.path for it in items], beam=beam, batch_size=batch_size)
    for path, out in progress(results, total=len(items), desc=run.label, unit="image"):
        if isinstance(out, ImageError):
            raise out
        res.captions[path.name] = out.text
        if path.name in shown:
            res.shown[path.name] = _attention(out, keep=True)
    return res


def thumbnail(path: Path, size: int = 224) -> tuple[str, int, int]:
    """A photo as a base64 JPEG at most ``size`` pixels on its longer side -> (data, w, h)."""
    from ..data.images import load_rgb

    photo = load_rgb(path)
    photo.thumbnail((size, size))
    buf = io.BytesIO()
    photo.save(buf, format="JPEG", quality=80)
    return base64.b64encode(buf.getvalue()).decode("ascii"), photo.width, photo.height


def _fmt_score(v: float, ci: tuple[float, float] | None) -> str:
    return f"{100 * v:.2f}" + (f' <span class="ci">[{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]</span>' if ci else "")


def build_report(runs: list[Run], split: str = "dev", images: int = 10, beam: int = 3, rounds: int = 1000,
                 seed: int = 0, score_opts: dict | None = None, progress=None,
                 max_images: int = 0) -> tuple[str, list[RunResult]]:
    """The report's HTML (see the module's doc) and each run's RunResult (its captions, scores and
    intervals: :func:`report_data`). ``score_opts``: captionkit.scoring.evaluation.score_captions options
    (metrics, tokenizer, meteor, brevity_penalty). ``max_images``: caption and score the first N
    images of the split only (0: all), as ``train.val_max_images`` validates on."""
    from ..data.datasets import load_dataset

    data = _same_data(runs)
    dataset = load_dataset(data["dataset"], data["images"] or None, data["image_column"], data["title_column"],
                           data["image_suffix"])
    items = dataset.split(split)
    train = [c for it in dataset.splits["train"] for c in it.raw] if "train" in dataset.splits else None
    if not items:
        raise UserError(f"{data['dataset']}: the {split} split is empty")
    split_size = len(items)
    items = items[:max_images] if max_images else items
    refs = {it.name: it.raw for it in items}
    shown_items = items[:images]
    shown = {it.name for it in shown_items}
    results = []
    for r in runs:
        if progress:
            progress(f"captioning {len(items)} {split} images with {r.label} ({r.checkpoint})")
        res = caption_split(r, items, shown, beam)
        rep = score_captions(res.captions, refs, quiet=True, source=str(r.checkpoint), **(score_opts or {}))
        res.scores, res.implementation = rep.scores, rep.implementation
        res.intervals = bootstrap(rep, rounds=rounds, seed=seed) if rounds else {}
        rows = diversity_rows(res.captions, None if results else refs, train, (score_opts or {}).get("tokenizer", "auto"))
        res.diversity, res.human = rows["captions"], rows.get("human", results[0].human if results else None)
        results.append(res)
    history_metrics = {k for r in runs for e in r.history for k in e}
    metrics = [m for m in default_metrics(runs) if m in history_metrics]
    x = "captions" if all(counts_captions(r) for r in runs) else "epochs"
    curves = base64.b64encode(draw_curves(curve_series(runs, metrics, x))).decode("ascii") if metrics else ""
    photos = {it.name: thumbnail(it.path) for it in shown_items}
    page = _html(results, shown_items, photos, curves, split=split, beam=beam, rounds=rounds,
                 dataset=str(data["dataset"]), n_images=len(items), split_size=split_size, x=x)
    return page, results


def report_data(results: list[RunResult], split: str, beam: int, rounds: int) -> dict:
    """What a report scored, as JSON (``captionkit report --data``): for tables elsewhere and for
    ``captionkit score``. Scores as the scorers give them (BLEU 0..1, CIDEr 0..10), not x100;
    each run's "diversity" and, at the top, the references' ("diversity": {"human": ...}) as
    captionkit.scoring.diversity gives them."""
    return {"split": split, "beam": beam, "bootstrap": rounds, "images": len(results[0].captions) if results else 0,
            "runs": [{"label": r.run.label, "run": str(r.run.path), "checkpoint": str(r.run.checkpoint),
                      "scores": r.scores, "intervals": {k: list(v) for k, v in r.intervals.items()},
                      "implementation": r.implementation, "captions": r.captions,
                      **({"diversity": r.diversity.as_dict()} if r.diversity else {})} for r in results],
            **({"diversity": {"human": results[0].human.as_dict()}} if results and results[0].human else {})}


# ---- the page ----------------------------------------------------------------------------
_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d232a;
       margin: 0 auto; padding: 20px 28px 60px; max-width: 1280px; }
h1 { font-size: 24px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; }
.meta, .note { color: #5b6670; } .note { font-size: 12.5px; margin: 4px 0 10px; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { border: 1px solid #d5dbe0; padding: 5px 8px; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; }
th { background: #f2f5f7; font-weight: 600; }
td.num { text-align: right; white-space: nowrap; overflow-wrap: normal; font-variant-numeric: tabular-nums; }
.best { font-weight: 700; } .ci { display: block; color: #6b7782; font-size: 12px; font-weight: 400; }
td.label { min-width: 14em; }
.run { font-weight: 600; } .path { color: #6b7782; font-size: 12px; word-break: break-all; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
img.curves { max-width: 100%; border: 1px solid #e3e7ea; }
table.captions { width: 100%; } table.captions td.photo { width: 232px; }
table.captions td.refs { width: 38%; } .photo-box { position: relative; }
.photo-box canvas { position: absolute; left: 0; top: 0; pointer-events: none; }
.photo-name { color: #6b7782; font-size: 12px; margin-top: 2px; word-break: break-all; }
ul.refs { margin: 0; padding-left: 18px; color: #3c4650; } ul.refs li { margin: 1px 0; }
.cap { margin: 0 0 6px; } .cap .run { display: block; font-size: 12px; color: #5b6670; font-weight: 600; }
.w.att { border-bottom: 1px dotted #7a8793; cursor: help; } .w.att:hover { background: #ffe28a; }
details summary { cursor: pointer; color: #37424c; }
"""

_SCRIPT = """
// Hovering a word darkens the photo where the model did not look (its attention over the grid,
// smoothed by the browser's scaling of a grid-sized image).
document.querySelectorAll('.w.att').forEach(function (w) {
  w.addEventListener('mouseenter', function () {
    var row = w.closest('tr'), box = row.querySelector('.photo-box'), img = box.querySelector('img');
    var canvas = box.querySelector('canvas'), cap = JSON.parse(w.parentNode.dataset.att);
    var a = cap.attention[+w.dataset.i], gh = cap.grid[0], gw = cap.grid[1];
    var small = document.createElement('canvas'); small.width = gw; small.height = gh;
    var sctx = small.getContext('2d'), data = sctx.createImageData(gw, gh), top = Math.max.apply(null, a) || 1;
    for (var i = 0; i < gh * gw; i++) { data.data[4 * i + 3] = Math.round(255 * 0.85 * (1 - a[i] / top)); }
    sctx.putImageData(data, 0, 0);
    canvas.width = img.width; canvas.height = img.height;
    var ctx = canvas.getContext('2d'); ctx.imageSmoothingEnabled = true;
    ctx.drawImage(small, 0, 0, canvas.width, canvas.height);
  });
  w.addEventListener('mouseleave', function () {
    var canvas = w.closest('tr').querySelector('canvas');
    canvas.getContext('2d').clearRect(0, 0, canvas.width, canvas.height);
  });
});
"""

_SETTING_COLUMNS = 6  # more differing settings than this are listed as rows, not columns
_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf"]  # matplotlib's tab10, the curves' colours


def _e(text) -> str:
    return html.escape(str(text))


def _caption_html(res: RunResult, name: str) -> str:
    cap = res.shown[name]
    if "attention" not in cap:
        return _e(" ".join(cap["words"]))
    words = " ".join(f'<span class="w att" data-i="{i}">{_e(w)}</span>' for i, w in enumerate(cap["words"]))
    payload = _e(json.dumps({"grid": cap["grid"], "attention": cap["attention"]}, separators=(",", ":")))
    return f'<span class="c" data-att="{payload}">{words}</span>'


def _diversity_html(results: list[RunResult]) -> str:
    """The diversity table: each run's captions and the references (the human row)."""
    rows = [(f"{swatch}<span class=\"run\">{_e(r.run.label)}</span>", r.diversity) for r, swatch in
            ((r, f'<span class="swatch" style="background:{_COLOURS[i % 10]}"></span>') for i, r in enumerate(results))
            if r.diversity]
    if results and results[0].human:
        rows.append(("<span class=\"run\">human (the references: the first of each image)</span>", results[0].human))
    if not rows:
        return ""
    names = shown_fields({str(i): d for i, (_, d) in enumerate(rows)})
    return ("<h2>Diversity</h2><div class=\"note\">How varied the captions are, on the words the scorers see "
            "(docs/scoring.md defines each figure); the human row: each image's first reference"
            + (", novel: not a training caption" if rows[0][1].novel_captions is not None else "") + ".</div>"
            "<table class=\"diversity\"><tr><th>captions</th>" + "".join(f"<th>{_e(LABELS[n])}</th>" for n in names)
            + "</tr>" + "".join(f"<tr><td class=\"label\">{label}</td>" +
                                "".join(f"<td class=\"num\">{_e(cell(d, n))}</td>" for n in names) + "</tr>"
                                for label, d in rows) + "</table>")


def _image_count(n: int, split_size: int) -> str:
    return f"{n} images" if n == split_size else f"its first {n} of {split_size} images"


def _html(results: list[RunResult], shown_items, photos, curves: str, split: str, beam: int, rounds: int,
          dataset: str, n_images: int, split_size: int, x: str) -> str:
    runs = [r.run for r in results]
    keys = differing_settings(runs)
    flat = [flatten(r.config) for r in runs]
    common = [k for k in flat[0] if k not in keys]
    swatch = {id(r): f'<span class="swatch" style="background:{_COLOURS[i % 10]}"></span>'
              for i, r in enumerate(runs)}
    out = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>captionkit report</title>"
           f"<style>{_CSS}</style></head><body>",
           f"<h1>captionkit report</h1><div class=\"meta\">{len(runs)} run{'s' * (len(runs) != 1)} &middot; "
           f"{_e(dataset)}, {_e(split)} split ({_image_count(n_images, split_size)}) &middot; beam {beam} &middot; "
           f"written {time.strftime('%Y-%m-%d %H:%M')}</div>"]
    # the runs and what differs: as columns when few settings differ, else as rows of their own table
    wide = len(keys) > _SETTING_COLUMNS
    columns = [] if wide else keys
    out.append("<h2>Runs</h2><table><tr><th>run</th>" + "".join(f"<th>{_e(k)}</th>" for k in columns) +
               "<th>best epoch</th><th>epochs</th><th>captions seen</th><th>trained parameters</th></tr>")
    for r, f in zip(runs, flat):
        best = best_entry(r.history, r.config.get("train", {}).get("val_metric", "CIDEr")) or {}
        params = trained_parameters(r.path)
        out.append(f"<tr><td>{swatch[id(r)]}<span class=\"run\">{_e(r.label)}</span>"
                   f"<div class=\"path\">{_e(r.path)}</div></td>" +
                   "".join(f"<td>{_e(format_value(f.get(k, '-')))}</td>" for k in columns) +
                   f"<td class=\"num\">{best.get('epoch', '')}</td>"
                   f"<td class=\"num\">{max((e['epoch'] for e in r.history), default=0)}</td>"
                   f"<td class=\"num\">{f'{sum(seen(e) for e in r.history):,}' if counts_captions(r) else ''}</td>"
                   f"<td class=\"num\">{'' if params is None else f'{params:,}'}</td></tr>")
    out.append("</table>")
    if wide:
        out.append(f"<details open><summary>{len(keys)} settings that differ</summary><table><tr><th>setting</th>" +
                   "".join(f"<th>{swatch[id(r)]}{_e(r.label)}</th>" for r in runs) + "</tr>" +
                   "".join(f"<tr><th>{_e(k)}</th>" + "".join(f"<td>{_e(format_value(f.get(k, '-')))}</td>" for f in flat)
                           + "</tr>" for k in keys) + "</table></details>")
    if common:
        out.append("<details><summary>settings shared by every run</summary><table>" +
                   "".join(f"<tr><th>{_e(k)}</th><td>{_e(format_value(flat[0][k]))}</td></tr>" for k in common) +
                   "</table></details>")
    # scores
    metrics = list(dict.fromkeys(k for r in results for k in r.scores))
    best = {m: max(r.scores.get(m, float("-inf")) for r in results) for m in metrics}
    out.append(f"<h2>Scores on the {_e(split)} split</h2><div class=\"note\">x100, "
               f"{_image_count(n_images, split_size)}, beam {beam}, "
               f"each model's own length penalty" +
               (f"; in brackets the 95% bootstrap interval over images ({rounds} resamples)" if rounds else "") +
               "; the best of each column in bold.</div>")
    out.append("<table><tr><th>run</th>" + "".join(f"<th>{_e(m)}</th>" for m in metrics) + "</tr>")
    for r in results:
        cells = "".join(f"<td class=\"num{' best' if r.scores.get(m) == best[m] and len(results) > 1 else ''}\">"
                        f"{_fmt_score(r.scores[m], r.intervals.get(m)) if m in r.scores else ''}</td>"
                        for m in metrics)
        out.append(f"<tr><td class=\"label\">{swatch[id(r.run)]}<span class=\"run\">{_e(r.run.label)}</span></td>{cells}</tr>")
    out.append("</table>")
    impl = results[0].implementation
    out.append("<div class=\"note\">" + "; ".join(f"{_e(k)}: {_e(v)}" for k, v in impl.items()) + "</div>")
    out.append(_diversity_html(results))
    if curves:
        out.append(f"<h2>Training curves</h2><div class=\"note\">x = {'captions seen' if x == 'captions' else 'epoch'}; "
                   "dev scores x100; the dev loss "
                   "is teacher-forced, without dropout.</div>"
                   f"<img class=\"curves\" alt=\"training curves\" src=\"data:image/png;base64,{curves}\">")
    # captions
    out.append(f"<h2>Captions: {len(shown_items)} {_e(split)} images</h2><div class=\"note\">The first "
               f"{len(shown_items)} images of the split. Hover an underlined word to see where the model "
               f"looked for it.</div><table class=\"captions\"><tr><th>image</th><th>references</th>"
               f"<th>captions</th></tr>")
    for it in shown_items:
        data, w, h = photos[it.name]
        caps = "".join(f"<div class=\"cap\"><span class=\"run\">{swatch[id(r.run)]}{_e(r.run.label)}</span>"
                       f"{_caption_html(r, it.name)}</div>" for r in results)
        out.append(f"<tr class=\"image\" data-image=\"{_e(it.name)}\"><td class=\"photo\"><div class=\"photo-box\">"
                   f"<img alt=\"{_e(it.name)}\" width=\"{w}\" height=\"{h}\" src=\"data:image/jpeg;base64,{data}\">"
                   f"<canvas></canvas></div><div class=\"photo-name\">{_e(it.name)}</div></td>"
                   "<td class=\"refs\"><ul class=\"refs\">" + "".join(f"<li>{_e(ref)}</li>" for ref in it.raw) + "</ul></td>"
                   f"<td>{caps}</td></tr>")
    out.append(f"</table><script>{_SCRIPT}</script></body></html>")
    return "\n".join(out)

