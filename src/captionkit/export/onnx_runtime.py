"""Run an exported captioner (``captionkit export onnx``) with onnxruntime.

The ONNX graphs are wrapped in the decoder step contract (``prepare``, ``init_state``,
``step``), so captions come from the very same greedy and beam search code as PyTorch's
(:mod:`captionkit.inference.decoding`), and a parity check compares the graphs, not two searches.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..core.errors import UserError
from ..data.images import Preprocess
from ..data.tokenizers import load_tokenizer
from ..data.vocab import Vocab
from ..inference.captioner import Captioner
from .checks import check_onnx_extra, read_manifest


def _session(path: Path, threads: int | None):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


class OrtMemory:
    """Per-image tensors (numpy, batch-first) and the initial state computed with them."""

    def __init__(self, tensors: dict[str, np.ndarray], state: tuple[np.ndarray, ...]):
        self.tensors = tensors
        self.state = state

    def index_select(self, idx: torch.Tensor) -> "OrtMemory":
        i = idx.numpy()
        return OrtMemory({k: v[i] for k, v in self.tensors.items()}, tuple(s[i] for s in self.state))


class OrtDecoder:
    """The init and step graphs behind the decoder step contract."""

    def __init__(self, manifest: dict, folder: Path, variant: str, threads: int | None):
        files = manifest["graphs"][variant]
        self.init = _session(folder / files["init"], threads)
        self.step_s = _session(folder / files["step"], threads)
        self.state_names = manifest["state"]
        self.init_outputs = manifest["init"]["outputs"]
        self.step_inputs = manifest["step"]["inputs"]
        self.attention_view = manifest.get("attention_view", "weights")  # the model's, as exported
        self.training = False

    def eval(self):
        return self

    def prepare(self, feats: torch.Tensor) -> OrtMemory:
        f = feats.float().contiguous().numpy()
        outs = dict(zip(self.init_outputs, self.init.run(self.init_outputs, {"feats": f})))
        state = tuple(outs.pop(n) for n in self.state_names)
        return OrtMemory({"feats": f, **outs}, state)

    def init_state(self, mem: OrtMemory):
        return tuple(torch.from_numpy(s) for s in mem.state)

    def step(self, tokens: torch.Tensor, state, mem: OrtMemory):
        feed = {"tokens": tokens.numpy().astype(np.int64)}
        feed.update({n: s.numpy() for n, s in zip(self.state_names, state)})
        feed.update(mem.tensors)
        outs = self.step_s.run(None, {k: feed[k] for k in self.step_inputs})
        logp, new_state, alpha = outs[0], outs[1:-1], outs[-1]
        return torch.from_numpy(logp), tuple(torch.from_numpy(s) for s in new_state), torch.from_numpy(alpha)


class OrtEncoder:
    def __init__(self, manifest: dict, folder: Path, variant: str, threads: int | None):
        self.session = _session(folder / manifest["graphs"][variant]["encoder"], threads)
        p = manifest["preprocess"]
        self.preprocess = Preprocess(size=int(p["size"]), mean=tuple(p["mean"]), std=tuple(p["std"]),
                                     resample=p.get("resample", "bicubic"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.session.run(["feats"], {"image": x.float().contiguous().numpy()})[0])

    def encode_batch(self, images: list[torch.Tensor]) -> torch.Tensor:
        """As :meth:`captionkit.encoders.base.Encoder.encode_batch`."""
        return self(torch.stack(images))

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """As :meth:`captionkit.encoders.base.Encoder.encode` (onnxruntime reads CPU memory)."""
        return self(pixels.cpu())


def load_onnx_captioner(folder: str | Path, variant: str = "float32", threads: int | None = None) -> Captioner:
    """A :class:`Captioner` whose encoder and decoder are the exported graphs."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    check_onnx_extra("captioning with an ONNX export", ("onnxruntime",))
    if variant not in manifest["graphs"]:
        raise UserError(f"{folder}: no {variant} graphs (have {', '.join(manifest['graphs'])})")
    cfg = manifest["config"]
    tokenizer = load_tokenizer(manifest.get("tokenizer", manifest["vocab"]))
    return Captioner(OrtDecoder(manifest, folder, variant, threads), tokenizer, cfg,
                     OrtEncoder(manifest, folder, variant, threads))


def parity_check(reference: Captioner, folder: str | Path, paths: list[Path], beam: int = 3,
                 variant: str = "float32", batch_size: int = 16, threads: int | None = None) -> dict:
    """Caption ``paths`` with PyTorch and with the exported graphs (same search code) and
    compare; also the largest feature and log-probability differences on the first batch."""
    from ..core.errors import ImageError

    onnx_cap = load_onnx_captioner(folder, variant, threads)
    ref = {p: r for p, r in reference.caption_files(paths, beam=beam, batch_size=batch_size)}
    got = {p: r for p, r in onnx_cap.caption_files(paths, beam=beam, batch_size=batch_size)}
    pairs = [(p, ref[p], got[p]) for p in paths
             if not isinstance(ref[p], ImageError) and not isinstance(got[p], ImageError)]
    differ = [{"image": str(p), "pytorch": a.text, "onnx": b.text} for p, a, b in pairs if a.text != b.text]
    return {"variant": variant, "images": len(pairs), "identical": len(pairs) - len(differ),
            "identical_share": (len(pairs) - len(differ)) / len(pairs) if pairs else float("nan"),
            "differ": differ, "numeric": _numeric_check(reference, onnx_cap)}


@torch.no_grad()
def _numeric_check(reference: Captioner, onnx_cap: Captioner) -> dict:
    """Largest absolute differences on a fixed pseudo-random image: features, first-step
    log-probabilities and attention."""
    from ..kernels import plain_pytorch
    size = reference.encoder.preprocess.size
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    f_ref, f_onnx = reference.encoder(x).float(), onnx_cap.encoder(x)
    tokens = torch.full((2,), Vocab.start, dtype=torch.long)
    with plain_pytorch():
        mem = reference.decoder.prepare(f_ref)
        lp_ref, _, a_ref = reference.decoder.step(tokens, reference.decoder.init_state(mem), mem)
    omem = onnx_cap.decoder.prepare(f_ref)
    lp_onnx, _, a_onnx = onnx_cap.decoder.step(tokens, onnx_cap.decoder.init_state(omem), omem)
    return {"features": float((f_ref - f_onnx).abs().max()),
            "logprobs": float((lp_ref - lp_onnx).abs().max()),
            "attention": float((a_ref - a_onnx).abs().max())}
