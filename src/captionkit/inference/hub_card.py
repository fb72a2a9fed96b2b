"""The model card ``captionkit push`` writes (captionkit.inference.hub): YAML metadata the Hub reads
(``library_name: captionkit``, ``pipeline_tag: image-to-text``, tags, datasets and a ``model-index``
holding the scores exactly as the scores file gives them), then the model's family, its training
data, the scores with the command that produces them, the sample photos' captions, its intended
use and limits, and its files. Everything comes from the folder pushed, the scores file and the
loaded model, never from the machine (no local paths, no dates), so a push writes the same card
twice."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..core.errors import UserError

# the scorers' keys (captionkit evaluate's JSON, scores.json) -> the Hub's metric type and the name shown
METRICS = {"Bleu_1": ("bleu", "BLEU-1"), "Bleu_2": ("bleu", "BLEU-2"), "Bleu_3": ("bleu", "BLEU-3"),
           "Bleu_4": ("bleu", "BLEU-4"), "METEOR": ("meteor", "METEOR"), "ROUGE_L": ("rouge", "ROUGE-L"),
           "CIDEr": ("cider", "CIDEr-D"), "SPICE": ("spice", "SPICE")}
OBJECTIVES = {"xe": "cross-entropy", "scst": "self-critical training"}  # train.objective, as the card says it


def read_scores(path: Path, folder: Path) -> dict:
    """A scores file: the JSON ``captionkit evaluate --out`` writes, or a shipped model's
    scores.json: an object with "scores" ({metric: number}, x100). One line for anything else,
    and for the scores of another model (its "model", when it names one, is not ``folder``)."""
    from .shipped import SHIPPED, model_folder

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--scores: {path}: no such file") from None
    except (OSError, ValueError) as e:
        raise UserError(f"--scores: {path}: unreadable JSON ({e})") from None
    scores = doc.get("scores") if isinstance(doc, dict) else None
    if not isinstance(scores, dict) or not scores or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in scores.values()):
        raise UserError(f"--scores: {path}: no \"scores\" of numbers (give the JSON `captionkit evaluate --out` writes)")
    if doc.get("scale", "x100") != "x100":
        raise UserError(f"--scores: {path}: scores on the scale {doc['scale']!r}; the card gives them x100")
    scored = doc.get("model")
    if isinstance(scored, dict):  # several --model decoded as one: not a folder that can be pushed
        raise UserError(f"--scores: {path}: scores of several --model decoded as one; push an ensemble folder "
                        f"(captionkit ensemble --out DIR) evaluated as one --model DIR")
    if isinstance(scored, str):
        named = model_folder(scored)
        same = named.resolve() == folder.resolve() or (named.parent == SHIPPED and named.name == folder.name)
        if not same:
            raise UserError(f"--scores: {path}: scores of {scored}, not of {folder}")
    return doc


def dataset_name(dataset: str) -> str:
    """A dataset as the card names it: its folder's or file's name, never the path on this machine."""
    p = PurePosixPath(str(dataset).replace(os.sep, "/").rstrip("/"))
    return p.stem if p.suffix.lower() in (".json", ".csv", ".tsv", ".jsonl") else p.name


@dataclass
class CardFacts:
    """What the card says, gathered by :func:`card_facts`."""

    repo_id: str
    kind: str  # "checkpoint" or "ensemble"
    families: list[str]
    encoder: str
    grid: list[int]
    feat_dim: int
    vocab_size: int
    parameters: int
    decoding: dict  # max_len, length_penalty, tta
    members: list[dict]  # an ensemble's: path, weight, family
    training: list[dict]  # per checkpoint: where, dataset, splits, objective, epochs, best
    files: list[str]
    scores: dict | None = None
    samples: list[tuple[str, str | None]] = field(default_factory=list)
    license: str | None = None
    dataset_ids: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ref(self) -> str:
        return f"hub:{self.repo_id}"


def _local_paths(cfg: dict, where: str) -> list[str]:
    """Warnings for a config naming folders on this machine (a language model, a vision model,
    a vocabulary): the model loads only where they exist."""
    found = []
    for section in ("model", "encoder", "vocab"):
        values = cfg.get(section)
        for key, value in (values.items() if isinstance(values, dict) else ()):
            if isinstance(value, str) and (os.path.isabs(value) or value.startswith(("./", "../", "~"))):
                found.append(f"{where}config.json names the local path {value!r} ({section}.{key}): the model "
                             f"loads only where that path exists")
    return found


def _training(cfg: dict, where: str) -> dict:
    train = cfg.get("train") if isinstance(cfg.get("train"), dict) else {}
    data, tc, state = train.get("data") or {}, train.get("train") or {}, cfg.get("state") or {}
    best = state.get("best_score")
    return {"where": where, "dataset": dataset_name(data["dataset"]) if data.get("dataset") else None,
            "train_split": data.get("train_split"), "val_split": data.get("val_split"),
            "tokenizer": data.get("tokenizer"), "objective": tc.get("objective"), "epochs": state.get("epoch"),
            "val_metric": tc.get("val_metric"), "best_epoch": state.get("best_epoch") if best is not None else None,
            "best_score": best, "from": "starting from another checkpoint's weights (its train.init)" if tc.get("init") else None}


def card_facts(folder: Path, cap, plan, samples: list[tuple[str, str | None]]) -> CardFacts:
    """The facts of the staged ``folder`` and the captioner ``cap`` loaded from the model pushed."""
    from .shipped import ENSEMBLE_FILE, SCORES_FILE, is_ensemble

    configs: list[tuple[str, dict]] = []
    members: list[dict] = []
    if is_ensemble(folder):
        doc = json.loads((folder / ENSEMBLE_FILE).read_text())
        for m in doc["members"]:
            cfg = json.loads((folder / m["path"] / "config.json").read_text())
            configs.append((f"{m['path']}/", cfg))
            members.append({"path": m["path"], "weight": m["weight"], "family": cfg["family"]})
    else:
        configs.append(("", json.loads((folder / "config.json").read_text())))
    first = configs[0][1]
    scores = json.loads((folder / SCORES_FILE).read_text()) if plan.scores is not None else None
    training = [_training(cfg, where) for where, cfg in configs]
    trained_on = sorted({t["dataset"] for t in training if t["dataset"]})
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return CardFacts(
        repo_id=plan.repo_id, kind="ensemble" if members else "checkpoint",
        families=[cfg["family"] for _, cfg in configs], encoder=first["encoder"]["name"],
        grid=list(first["encoder"]["grid"]), feat_dim=int(first["model"].get("feat_dim", 0)),
        vocab_size=len(cap.vocab), parameters=sum(p.numel() for p in cap.decoder.parameters()),
        decoding={"max_len": cap.max_len, "length_penalty": cap.length_penalty, "tta": cap.tta,
                  "rerank": cap.own_rerank.entry() if cap.own_rerank else None},
        members=members, training=training, files=files, scores=scores, samples=samples,
        license=plan.license, dataset_ids=list(plan.dataset_ids or trained_on),
        warnings=[w for where, cfg in configs for w in _local_paths(cfg, where)])


# ---- rendering -------------------------------------------------------------------------------------
def metadata_yaml(f: CardFacts) -> str:
    """The card's YAML front matter, written by huggingface_hub's ModelCardData (the Hub's own
    schema: its model-index is what the Hub shows as evaluation results)."""
    from huggingface_hub import EvalResult, ModelCardData

    tags = ["captionkit", "image-captioning", *dict.fromkeys(f.families), f.encoder]
    if f.kind == "ensemble":
        tags.append("ensemble")
    results = None
    if f.scores:
        ds = dataset_name(f.scores.get("dataset", "unknown"))
        results = [EvalResult(task_type="image-to-text", task_name="Image captioning", dataset_type=ds,
                              dataset_name=ds, dataset_split=f.scores.get("split"),
                              metric_type=METRICS.get(k, (k.lower(), k))[0], metric_name=METRICS.get(k, (k, k))[1],
                              metric_value=v)
                   for k, v in f.scores["scores"].items()]
    data = ModelCardData(library_name="captionkit", pipeline_tag="image-to-text", license=f.license,
                         tags=list(dict.fromkeys(tags)), datasets=f.dataset_ids or None,
                         model_name=f.repo_id if results else None, eval_results=results)
    return data.to_yaml()


def evaluate_command(f: CardFacts) -> str:
    """The ``captionkit evaluate`` command giving the card's scores for the pushed model."""
    s = f.scores or {}
    words = ["captionkit evaluate --model", f.ref, "--dataset", dataset_name(s.get("dataset", "DATASET")),
             "--split", str(s.get("split", "test")), "--beam", str(s.get("beam", 3))]
    if s.get("max_images"):
        words += ["--max-images", str(s["max_images"])]
    if s.get("mbr_nbest"):
        words += ["--rerank mbr --nbest", str(s["mbr_nbest"])]
    lp = s.get("length_penalty")
    if isinstance(lp, (int, float)) and float(lp) != float(f.decoding["length_penalty"]):
        words += ["--length-penalty", f"{lp:g}"]
    if "tta" in s and s["tta"] != f.decoding["tta"]:
        words += ["--tta", s["tta"] or "none"]
    return " ".join(words)


def _table(rows: list[tuple[str, str]], header: tuple[str, str] = ("", "")) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    return "\n".join(lines + [f"| {a} | {b} |" for a, b in rows])


# what a model card says of each test-time augmentation (captionkit.inference.ensemble.TTA)
TTA_WORDS = {"flip": ", each photo also decoded mirrored",
             "flip-zoom": ", each photo also decoded mirrored, centre-cropped and both"}


def _model_rows(f: CardFacts) -> list[tuple[str, str]]:
    family = " + ".join(dict.fromkeys(f.families)) + (" ensemble" if f.kind == "ensemble" else "")
    d = f.decoding
    decoding = f"beam 3 (`--beam`), at most {d['max_len']} tokens, beams ranked by log-probability / " \
               f"(length + 1) ^ {d['length_penalty']:g}" + TTA_WORDS.get(d["tta"], "") \
        + (f"; the caption chosen among the {r['nbest']} best by its matcher (weight {r['weight']:g}, "
           f"rare-word gain {r['rare_weight']:g}; `--rerank none`: the beam's best)" if (r := d.get("rerank")) else "")
    rows = [("family", f"`{family}` ({f.parameters:,} decoder parameters)"),
            ("encoder", f"`{f.encoder}`: a {f.grid[0]}x{f.grid[1]} grid of {f.feat_dim}-d vectors"),
            ("vocabulary", f"{f.vocab_size:,} tokens"), ("decoding", decoding)]
    for i, m in enumerate(f.members, 1):
        rows.append((f"member {i}", f"`{m['path']}/`: `{m['family']}`, weight {m['weight']:g}"))
    return rows


def _training_lines(f: CardFacts) -> list[str]:
    lines = []
    for t in f.training:
        who = f"`{t['where'].rstrip('/')}`: " if t["where"] else ""
        if not t["dataset"]:
            lines.append(f"- {who}its config.json records no training data.")
            continue
        text = f"- {who}trained on the `{t['train_split']}` split of `{t['dataset']}`"
        if t["objective"]:
            objective = OBJECTIVES.get(t["objective"], t["objective"])
            epochs = t["epochs"]
            text += f" ({objective}, {epochs} epoch{'s' if epochs != 1 else ''})" if epochs else f" ({objective})"
        if t["from"]:
            text += f", {t['from']}"
        if t["best_score"] is not None and t["val_split"]:
            text += (f"; the checkpoint of epoch {t['best_epoch']}, best on the `{t['val_split']}` split by "
                     f"{t['val_metric']} ({100 * t['best_score']:.2f})")
        lines.append(text + ".")
    return lines


def _scores_section(f: CardFacts) -> list[str]:
    s = f.scores
    if not s:
        return ["No scores were given with this model (`captionkit push --scores`, the JSON "
                "`captionkit evaluate --out` writes)."]
    images = s.get("images") or (len(s["captions"]) if isinstance(s.get("captions"), dict) else None)
    scorers = s.get("scorers") or s.get("tokenizer")
    intro = (f"The `{s.get('split', '?')}` split of `{dataset_name(s.get('dataset', '?'))}`"
             + (f", {images:,} images" if images else "") + f", beam {s.get('beam', '?')}, scores x100"
             + (f"; scorers: {scorers}" if scorers else "") + ":")
    rows = [(METRICS.get(k, (k, k))[1], str(v)) for k, v in s["scores"].items()]
    return [intro, "", _table(rows, ("metric", "score")), "",
            "They are `scores.json` as it was written, and the `model-index` above. The command that gives them "
            "(with the dataset where it is on your machine):", "", "```sh", evaluate_command(f), "```"]


def _samples_section(f: CardFacts) -> list[str]:
    if not f.samples:
        return ["`captionkit push` was given no sample photos (`--samples`)."]
    rows = [(f"`{name}`", text if text is not None else "(could not be read)") for name, text in f.samples]
    return ["Captioned by this model when it was pushed (beam 3, on the CPU, float32):", "",
            _table(rows, ("photo", "caption"))]


def _limits(f: CardFacts) -> list[str]:
    data = ", ".join(f"`{d}`" for d in sorted({t["dataset"] for t in f.training if t["dataset"]})) or "its training data"
    lines = [f"- Intended for describing photos like those of {data} in one short sentence, in the language of "
             f"its training captions, at most {f.decoding['max_len']} tokens: alt text to review, search, "
             f"browsing a collection, research on captioning.",
             "- Photos unlike its training data get fluent but often wrong captions; scores on one dataset's test "
             "split say little about other photos. Check captions before anyone relies on them.",
             "- It repeats its training captions' habits and biases (who is said to do what, gendered words). Do "
             "not use it to identify people or to infer sensitive attributes."]
    lines += [f"- {w}." for w in f.warnings]
    return lines


def _files_section(f: CardFacts) -> list[str]:
    from .hub import DIGEST_FILE

    shown = [n for n in f.files if not n.endswith(".captionkit.json")]
    return [", ".join(f"`{n}`" for n in shown + [DIGEST_FILE]) + ".",
            "", f"`{DIGEST_FILE}` holds the sha256 of every file but this card: captionkit checks each file it "
            f"downloads against it and refuses one that differs. Pin a revision (`--model {f.ref}@COMMIT`) to "
            f"keep to the files you checked."]


def render_card(f: CardFacts) -> str:
    """README.md: the YAML front matter (:func:`metadata_yaml`), then the card's text."""
    name = f.repo_id.split("/")[-1]
    body = [f"# {name}", "",
            "An image captioning model for [captionkit](https://pypi.org/project/captionkit/), pushed with "
            "`captionkit push`.", "", "## Use", "", "```sh", "pip install 'captionkit[hub]'",
            f"captionkit caption --model {f.ref} photo.jpg", "```", "", "```python",
            "import captionkit", "", f'cap = captionkit.Captioner.from_pretrained("{f.repo_id}")',
            'print(cap("photo.jpg").text)', "```", "", "## Model", "", _table(_model_rows(f)), "",
            "## Training data", "", *_training_lines(f), "", "## Scores", "", *_scores_section(f), "",
            "## Sample captions", "", *_samples_section(f), "", "## Intended use and limits", "", *_limits(f), "",
            "## Files", "", *_files_section(f)]
    return f"---\n{metadata_yaml(f)}\n---\n\n" + "\n".join(body) + "\n"
