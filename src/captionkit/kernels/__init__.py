"""A fused CPU kernel for the soft-attention energy, with a PyTorch fallback.

``attention_energy(proj, q, w)`` computes e[b, l] = w . tanh(proj[b, l] + q[b]) for
proj (B, L, A), q (B, A), w (A). The C version (``attention.c``) is compiled with the
machine's C compiler on first use and cached; where no compiler is found, or
``CAPTIONKIT_KERNELS=0`` is set, the same function runs in plain PyTorch. Both give the same
values and gradients (tested).

The C kernel reads host memory: it is a CPU path only (``KERNEL_DEVICE``). For tensors on any
other device (CUDA, MPS) :func:`_check` is False and the PyTorch path runs, which there is
a few fused GPU kernels anyway; this is the one place that choice is made.

For training, :class:`EnergyContext` wraps a batch's ``proj`` once, so that the gradient of
``proj`` is accumulated in place across all time steps instead of being summed by autograd.
The SAT decoder's fused training recurrence (models/sat_recurrence.py) runs the per-word kernels
of ``recurrence.c`` and the few-row matmuls of ``gemm.c`` (:class:`RowProducts`), all in the same
library; decoding's few-row products run ``gemm.c`` too (:func:`packed_linear`, through
``models.base.Linear``), and EfficientNet-Lite's large blocks ``conv.c``
(:func:`expand_depthwise`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..core.cache import cache_dir

_SOURCES = [Path(__file__).with_name(n) for n in ("attention.c", "recurrence.c", "gemm.c", "conv.c")]  # one library
_lib = None
_tried = False
_plain = 0  # > 0 inside ``plain_pytorch()``


def _load():
    """Compile (once per source, machine and compiler) and load the C kernels, or None."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("CAPTIONKIT_KERNELS", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    # Compiled with -ffast-math (vectorised tanhf) but linked without it: linked with it, the
    # compiler adds crtfastmath.o, whose constructor sets flush-to-zero for the whole process the
    # moment the library loads, so every later numpy and torch op would silently lose subnormals.
    compile_flags = ["-O3", "-ffast-math", "-march=native", "-fopenmp", "-fPIC", "-c"]
    link_flags = ["-shared", "-fopenmp"]
    key = hashlib.sha1(b"".join(src.read_bytes() for src in _SOURCES)
                       + " ".join([cc, platform.machine(), platform.node(), *compile_flags, "|", *link_flags]).encode())
    so = cache_dir("kernels") / f"attention-{key.hexdigest()[:12]}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        objs = [f"{tmp[:-3]}-{src.stem}.o" for src in _SOURCES]
        for src, obj in zip(_SOURCES, objs):
            r = subprocess.run([cc, *compile_flags, str(src), "-o", obj], capture_output=True, text=True)
            if r.returncode != 0:
                break
        else:
            r = subprocess.run([cc, *link_flags, *objs, "-o", tmp, "-lm"], capture_output=True, text=True)
        for obj in objs:
            if os.path.exists(obj):
                os.unlink(obj)
        if r.returncode != 0:
            os.unlink(tmp)
            print(f"captionkit: fused attention kernel did not compile, using PyTorch ({r.stderr.strip()[:200]})",
                  file=sys.stderr)
            return None
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    P, L_, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.attn_energy_fwd.argtypes = [P, P, L_, P, P, L_, L_, L_, I, I]
    lib.attn_energy_bwd.argtypes = [P, P, P, L_, P, P, P, P, L_, L_, L_, I, I]
    lib.attn_energy_bwd.restype = I
    lib.attn_softmax_fwd.argtypes = [P, P, L_, P, P, L_, L_, L_, I]
    lib.attn_softmax_bwd.argtypes = [P, P, P, P, P, L_, P, P, P, P, L_, L_, L_, I]
    lib.attn_softmax_bwd.restype = I
    lib.gate_fwd.argtypes = [P, L_, P, P, P, L_, L_]
    lib.gate_bwd.argtypes = [P, P, P, P, L_, L_, L_]
    lib.lstm_fwd.argtypes = [P, P, L_, P, P, P, P, P, P, L_, L_, I]
    lib.lstm_bwd.argtypes = [P, P, P, P, P, P, P, L_, L_, L_, I]
    lib.half_supported.restype = I
    lib.to_half_exact.argtypes = [P, P, L_, I]
    lib.to_half_exact.restype = L_
    lib.attend_fwd_half.argtypes = [P, P, P, L_, P, P, P, P, P, P, L_, L_, L_, L_, I]
    lib.attend_bwd_half.argtypes = [P, P, P, P, P, P, P, P, P, L_, P, P, P, P, L_, L_, L_, L_, I]
    lib.attend_bwd_half.restype = I
    declare_gemm(lib)
    lib.expand_dw_supported.restype = I
    lib.expand_dw.argtypes = [P, L_, L_, L_, L_, P, P, P, P, L_, I, I, I, I, L_, L_, P, I]
    lib.expand_dw.restype = I
    _lib = lib
    return lib


def declare_gemm(lib: ctypes.CDLL) -> ctypes.CDLL:
    """gemm.c's functions' ctypes signatures on ``lib`` (the kernels' library, or a build of
    gemm.c alone, as a test compiles it for another vector width)."""
    P, L_, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.gemm_supported.restype = I
    lib.gemm_preferred.restype = I
    lib.gemm_panel.restype = I
    lib.pack_panels.argtypes = [P, L_, I, L_, L_, P, I]
    lib.gemm_packed.argtypes = [P, L_, L_, L_, P, L_, P, P, L_, P, L_, I]
    return lib


def kernel_available() -> bool:
    return _plain == 0 and _load() is not None


@contextlib.contextmanager
def plain_pytorch():
    """Inside this block the attention energy runs in plain PyTorch, e.g. while a model is
    traced for ONNX export (a graph cannot call the C kernel)."""
    global _plain
    _plain += 1
    try:
        yield
    finally:
        _plain -= 1


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


KERNEL_DEVICE = "cpu"  # the only device type the C kernel runs on


def _check(*ts: torch.Tensor) -> bool:
    """May the C kernel take these tensors? float32, contiguous, and on the CPU."""
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == KERNEL_DEVICE for t in ts)


def energy_reference(proj: torch.Tensor, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: (B, L, A), (B, A), (A,) -> (B, L)."""
    return torch.tanh(proj + q.unsqueeze(1)) @ w


def _fwd(lib, proj, q, w, rational: bool = False) -> torch.Tensor:
    B, L, A = proj.shape
    e = torch.empty(B, L, dtype=torch.float32)
    lib.attn_energy_fwd(_ptr(proj), _ptr(q), A, _ptr(w), _ptr(e), B, L, A, torch.get_num_threads(), int(rational))
    return e


def energy_forward(proj: torch.Tensor, q: torch.Tensor, w: torch.Tensor, *, rational: bool = False) -> torch.Tensor:
    """The C kernel's energy, no autograd: (B, L, A), (B, A), (A,) -> (B, L). For callers
    that write their own backward (the SAT decoder's fused recurrence runs it with the softmax:
    :func:`attention_softmax`); only where ``kernel_available()`` and ``_check`` hold, e.g.
    with A = 1, w = 1 and q = 0 it is the kernel's tanh itself. ``rational``: tanh from the kernel's rational
    approximation (within 3e-7 of tanh, 2-3x faster than glibc's) instead of glibc's
    ``tanhf``; teacher-forced training takes it, decoding keeps ``tanhf`` (its captions stay
    the same bit for bit)."""
    return _fwd(_load(), proj, q, w, rational)


def energy_backward(ge: torch.Tensor, proj: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                    gproj: torch.Tensor, gq: torch.Tensor, gw: torch.Tensor, *, rational: bool = False) -> None:
    """The C kernel's backward of :func:`energy_forward` for ge (B, L): adds into gproj
    (B, L, A) and gw (A,), writes gq (B, A). All float32 and contiguous. ``rational`` as in
    the forward."""
    B, L, A = proj.shape
    if _load().attn_energy_bwd(_ptr(ge), _ptr(proj), _ptr(q), A, _ptr(w), _ptr(gproj), _ptr(gq), _ptr(gw),
                               B, L, A, torch.get_num_threads(), int(rational)) != 0:
        raise MemoryError("attention kernel could not allocate its buffer")


# ---- the SAT recurrence's per-word kernels (recurrence.c), for models/sat_recurrence.py ----
# float32 CPU tensors; a column slice of h_proj's output (B, A + 1 + 4H) is read or written in
# place, its row stride passed on as ``ld``. Attention uses the rational tanh.

def _need(*contiguous: torch.Tensor, strided: tuple[torch.Tensor, ...] = ()) -> None:
    """Internal contract of these kernels: float32 CPU tensors, ``contiguous`` ones contiguous,
    ``strided`` ones matrices with contiguous rows or vectors of any stride (passed with ``ld``)."""
    layouts = [t.is_contiguous() for t in contiguous] + [t.dim() == 1 or (t.dim() == 2 and t.stride(1) == 1)
                                                         for t in strided]
    for t, ok in zip((*contiguous, *strided), layouts):
        if not (ok and t.dtype == torch.float32 and t.device.type == KERNEL_DEVICE):
            raise RuntimeError(f"recurrence kernel given a {t.dtype} {t.device} tensor of strides {t.stride()}")


def attention_softmax(proj: torch.Tensor, q: torch.Tensor, w: torch.Tensor, alpha: torch.Tensor) -> None:
    """alpha (B, L) <- softmax over l of w . tanh(proj[b, l] + q[b]); proj (B, L, A), q (B, A)."""
    B, L, A = proj.shape
    _need(proj, w, alpha, strided=(q,))
    _load().attn_softmax_fwd(_ptr(proj), _ptr(q), q.stride(0), _ptr(w), _ptr(alpha), B, L, A, torch.get_num_threads())


def attention_softmax_backward(d_alpha: torch.Tensor, g_alpha: torch.Tensor | None, alpha: torch.Tensor,
                               proj: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                               gproj: torch.Tensor, gq: torch.Tensor, gw: torch.Tensor) -> None:
    """Backward of :func:`attention_softmax` for alpha's gradient d_alpha (+ g_alpha): adds
    into gproj (B, L, A) and gw (A,), writes gq (B, A)."""
    B, L, A = proj.shape
    _need(d_alpha, alpha, proj, w, gproj, gw, *([] if g_alpha is None else [g_alpha]), strided=(q, gq))
    if _load().attn_softmax_bwd(_ptr(d_alpha), None if g_alpha is None else _ptr(g_alpha), _ptr(alpha), _ptr(proj),
                                _ptr(q), q.stride(0), _ptr(w), _ptr(gproj), _ptr(gq), _ptr(gw), B, L, A,
                                torch.get_num_threads()) != 0:
        raise MemoryError("attention kernel could not allocate its buffer")


def gate_forward(beta_logit: torch.Tensor, zc: torch.Tensor, beta: torch.Tensor, z: torch.Tensor) -> None:
    """beta (B,) <- sigmoid(beta_logit (B,)); z (B, D) <- beta zc."""
    _need(zc, beta, z, strided=(beta_logit,))
    _load().gate_fwd(_ptr(beta_logit), beta_logit.stride(0), _ptr(zc), _ptr(beta), _ptr(z), *zc.shape)


def gate_backward(dz: torch.Tensor, zc: torch.Tensor, beta: torch.Tensor, g_logit: torch.Tensor) -> None:
    """dz (B, D), the gated context's gradient, becomes the ungated one's; g_logit (B,) <- beta's logit's."""
    _need(dz, zc, beta, strided=(g_logit,))
    _load().gate_bwd(_ptr(dz), _ptr(zc), _ptr(beta), _ptr(g_logit), g_logit.stride(0), *dz.shape)


def lstm_forward(gz: torch.Tensor, gh: torch.Tensor, gx: torch.Tensor, c_prev: torch.Tensor,
                 acts: torch.Tensor, c: torch.Tensor, tanh_c: torch.Tensor, h: torch.Tensor) -> None:
    """The LSTM cell on pre-activations gz + gh + gx (B, 4H each, [i f g o]): writes acts
    (B, 4H), c, tanh(c) and h (B, H)."""
    B, H = c_prev.shape
    _need(gz, gx, c_prev, acts, c, tanh_c, h, strided=(gh,))
    _load().lstm_fwd(_ptr(gz), _ptr(gh), gh.stride(0), _ptr(gx), _ptr(c_prev), _ptr(acts), _ptr(c), _ptr(tanh_c),
                     _ptr(h), B, H, torch.get_num_threads())


def lstm_backward(dh: torch.Tensor, dh_out: torch.Tensor, dc: torch.Tensor, acts: torch.Tensor,
                  tanh_c: torch.Tensor, c_prev: torch.Tensor, dgates: torch.Tensor) -> None:
    """Backward of :func:`lstm_forward` for h's gradient dh + dh_out and c's gradient dc
    (replaced by c_prev's): writes the pre-activations' gradient dgates (B, 4H)."""
    B, H = dh.shape
    _need(dh, dh_out, dc, acts, tanh_c, c_prev, strided=(dgates,))
    _load().lstm_bwd(_ptr(dh), _ptr(dh_out), _ptr(dc), _ptr(acts), _ptr(tanh_c), _ptr(c_prev), _ptr(dgates),
                     dgates.stride(0), B, H, torch.get_num_threads())


def _need_half(t: torch.Tensor) -> None:
    if t.dtype != torch.float16 or t.device.type != KERNEL_DEVICE or not t.is_contiguous():
        raise RuntimeError(f"context kernel given a {t.dtype} {t.device} tensor of strides {t.stride()}")


def half_copy(feats: torch.Tensor) -> torch.Tensor | None:
    """feats (B, L, D) float32 as float16, or None where a value does not convert exactly (or
    the compiler has no float16): the attend kernels below read half the bytes and compute
    the float32 products. Features from the feature store are float16 values (one pass here
    finds out)."""
    _need(feats)
    lib = _load()
    if not lib.half_supported():
        return None
    out = torch.empty(feats.shape, dtype=torch.float16)
    bad = lib.to_half_exact(_ptr(feats), _ptr(out), feats.numel(), torch.get_num_threads())
    return out if bad == 0 else None


def attend_forward(proj: torch.Tensor, hp: torch.Tensor, w: torch.Tensor, feats_half: torch.Tensor, gate: bool,
                   alpha: torch.Tensor, zc: torch.Tensor, beta: torch.Tensor, z: torch.Tensor) -> None:
    """A word's attention in one pass a caption, for float16 features (:func:`half_copy`):
    alpha (B, L) <- the softmax of the energies of proj (B, L, A) and q = hp[:, :A];
    zc (B, D) <- alpha . feats_half (B, L, D); with ``gate``, beta (B,) <- sigmoid(hp[:, A])
    and z (B, D) <- beta zc (z and beta untouched otherwise). hp: h_proj's output (B, >A)."""
    B, L, A = proj.shape
    _need(proj, w, alpha, zc, beta, z, strided=(hp,))
    _need_half(feats_half)
    D = feats_half.shape[2]
    _load().attend_fwd_half(_ptr(proj), _ptr(hp), _ptr(hp[:, A]) if gate else None, hp.stride(0), _ptr(w),
                            _ptr(feats_half), _ptr(alpha), _ptr(zc), _ptr(beta), _ptr(z), B, L, A, D,
                            torch.get_num_threads())


def attend_backward(dz: torch.Tensor, zc: torch.Tensor, beta: torch.Tensor, gate: bool, alpha: torch.Tensor,
                    g_alpha: torch.Tensor | None, feats_half: torch.Tensor, proj: torch.Tensor,
                    hp: torch.Tensor, w: torch.Tensor, gproj: torch.Tensor, g_hp: torch.Tensor,
                    gw: torch.Tensor) -> None:
    """Backward of :func:`attend_forward` for dz (B, D), the context's gradient (gated, with
    ``gate``: then dz becomes the ungated one's and g_hp[:, A] beta's logit's), and g_alpha
    (B, L), the loss's own gradient of alpha (or None). Adds into gproj (B, L, A) and gw (A);
    writes g_hp[:, :A], the query's gradient. hp and g_hp: (B, >A), rows equally far apart."""
    B, L, A = proj.shape
    _need(dz, zc, beta, alpha, proj, w, gproj, gw, *([] if g_alpha is None else [g_alpha]), strided=(hp, g_hp))
    _need_half(feats_half)
    if hp.stride(0) != g_hp.stride(0):
        raise RuntimeError(f"attend_backward: hp and g_hp rows {hp.stride(0)} and {g_hp.stride(0)} floats apart")
    if _load().attend_bwd_half(_ptr(dz), _ptr(zc), _ptr(beta), _ptr(g_hp[:, A]) if gate else None, _ptr(alpha),
                               None if g_alpha is None else _ptr(g_alpha), _ptr(feats_half), _ptr(proj), _ptr(hp),
                               hp.stride(0), _ptr(w), _ptr(gproj), _ptr(g_hp), _ptr(gw), B, L, A,
                               feats_half.shape[2], torch.get_num_threads()) != 0:
        raise MemoryError("attention kernel could not allocate its buffer")


# ---- products of a few rows by one weight many times (gemm.c): the recurrence's per-word matmuls ----

def gemm_preferred() -> bool:
    """Do :class:`RowProducts` run gemm.c's packed kernel here? Where the kernels load and the
    CPU has AVX2 + FMA (AVX-512 included: there the kernel's 512-bit tile ran 1.6-1.9x MKL's
    path at the training step's shapes, on an AMD EPYC Zen 4)."""
    return kernel_available() and bool(_load().gemm_preferred())


class RowProducts:
    """out (M, N) = x (M, K) W^T (+ a bias or an addend) for many x of few rows (a batch, one
    word at a time) and one weight: W = ``w`` (N, K), or ``w.t()`` for ``transposed=True``
    (w (K, N)). With ``packed`` (default: :func:`gemm_preferred`), W is packed once here and
    gemm.c's kernel writes out directly; otherwise PyTorch computes W x^T (weight on the left:
    with 32 rows MKL ran that form 1.2-1.7x faster than x W^T on AVX2) and copies its
    transpose into out. x, out and addend may be row slices of wider matrices (rows
    contiguous). Both ways give the same values up to float32 rounding (tested)."""

    def __init__(self, w: torch.Tensor, *, transposed: bool = False, packed: bool | None = None):
        _need(w)
        self.w = w.t() if transposed else w  # (N, K), a view
        self.n, self.k = self.w.shape
        self.packed = None
        if gemm_preferred() if packed is None else packed:
            if not (kernel_available() and _load().gemm_supported()):
                raise RuntimeError("RowProducts(packed=True): gemm.c's kernel is not built here (needs AVX2 and FMA)")
            panel = _load().gemm_panel()  # outputs a packed panel: 24 (AVX2) or 48 (AVX-512)
            self.packed = torch.empty(-(-self.n // panel), self.k, panel)
            _load().pack_panels(_ptr(w), w.stride(0), int(transposed), self.n, self.k, _ptr(self.packed),
                                torch.get_num_threads())
        self._tmp = None  # (N, M): PyTorch's W x^T before its transpose is copied out

    def __call__(self, x: torch.Tensor, out: torch.Tensor, *, bias: torch.Tensor | None = None,
                 addend: torch.Tensor | None = None) -> torch.Tensor:
        """out <- x W^T + (bias (N,) or addend (M, N) or 0); returns out."""
        m = x.shape[0]
        if x.shape != (m, self.k) or out.shape != (m, self.n) or (addend is not None and addend.shape != out.shape):
            raise RuntimeError(f"RowProducts of W {tuple(self.w.shape)}: x {tuple(x.shape)}, out {tuple(out.shape)}")
        _need(*([] if bias is None else [bias]), strided=(x, out, *([] if addend is None else [addend])))
        if self.packed is not None:
            _load().gemm_packed(_ptr(x), x.stride(0), m, self.k, _ptr(self.packed), self.n,
                                None if bias is None else _ptr(bias), None if addend is None else _ptr(addend),
                                0 if addend is None else addend.stride(0), _ptr(out), out.stride(0),
                                torch.get_num_threads())
            return out
        if self._tmp is None or self._tmp.shape[1] != m:
            self._tmp = torch.empty(self.n, m)
        if bias is None:
            torch.mm(self.w, x.t(), out=self._tmp)
        else:
            torch.addmm(bias.unsqueeze(1), self.w, x.t(), out=self._tmp)
        if addend is None:
            return out.copy_(self._tmp.t())
        return torch.add(addend, self._tmp.t(), out=out)


class _PassGrad(torch.autograd.Function):
    """Identity on proj whose gradient is the buffer the energy steps accumulated into."""

    @staticmethod
    def forward(ctx, proj, buf):
        ctx.buf = buf
        ctx.set_materialize_grads(False)
        return proj.view_as(proj)

    @staticmethod
    def backward(ctx, g):
        return (ctx.buf if g is None else ctx.buf + g), None


class _Energy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, proj, q, w, buf):
        lib = _load()
        q, w = q.contiguous(), w.contiguous()
        ctx.save_for_backward(proj, q, w)
        ctx.buf = buf
        return _fwd(lib, proj, q, w)

    @staticmethod
    def backward(ctx, ge):
        proj, q, w = ctx.saved_tensors
        B, L, A = proj.shape
        gq = torch.empty(B, A)
        gw = torch.zeros(A)
        rc = _load().attn_energy_bwd(_ptr(ge.contiguous().float()), _ptr(proj), _ptr(q), A, _ptr(w),
                                     _ptr(ctx.buf), _ptr(gq), _ptr(gw), B, L, A, torch.get_num_threads(), 0)
        if rc != 0:
            raise MemoryError("attention kernel could not allocate its buffer")
        return None, gq, gw, None


class EnergyContext:
    """The attention energy for one batch: wrap ``proj`` once, call it once per time step."""

    def __init__(self, proj: torch.Tensor, use_kernel: bool | None = None):
        proj = proj.float().contiguous()
        self.fused = (kernel_available() if use_kernel is None else use_kernel) and _check(proj)
        self.buf = None
        if self.fused and proj.requires_grad:
            self.buf = torch.zeros_like(proj)
            proj = _PassGrad.apply(proj, self.buf)
        self.proj = proj  # (B, L, A)

    def __call__(self, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q, w = q.float(), w.float()
        if not self.fused:
            return energy_reference(self.proj, q, w)
        if self.buf is None and not (q.requires_grad or w.requires_grad):
            return _fwd(_load(), self.proj.detach(), q.detach().contiguous(), w.detach().contiguous())
        if self.buf is None:  # proj is constant but q/w need gradients
            self.buf = torch.zeros_like(self.proj)
        return _Energy.apply(self.proj, q, w, self.buf)


# ---- inference's products in gemm.c's packed kernel: decoding steps' few-row matmuls ----

# weight -> (its _version and data pointer when packed, its RowProducts); freed with the weight
_packed_weights = torch.utils.weak.WeakTensorKeyDictionary()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x (..., K) W^T + bias by gemm.c's packed kernel, or None where this is not that kernel's
    case: float32 CPU tensors, no gradient asked for (decoding: a beam step's products have a
    few dozen rows, where MKL re-packs the weight at every call), no autocast, not traced or
    compiled, and the kernel preferred here (:func:`gemm_preferred`). The weight is packed on
    its first use and kept until it changes in place (as ``load_state_dict`` and PyTorch's
    in-place operations change it, which PyTorch counts; the fused Adam optimizer's steps and
    writes through ``weight.data`` are not counted, and not seen: callers pack only weights done
    changing, ``models.base.pack_products``), gets new storage, or is freed. Each output row depends on
    its own input row only (not on how many rows share the call), and its value is float32
    rounding away from PyTorch's (tested). Callers run their own PyTorch product on None."""
    if (torch.is_grad_enabled() or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != KERNEL_DEVICE or weight.device.type != KERNEL_DEVICE
            or (bias is not None and (bias.dtype != torch.float32 or bias.device.type != KERNEL_DEVICE))
            or torch.is_autocast_enabled(KERNEL_DEVICE) or torch.jit.is_tracing() or torch.compiler.is_compiling()
            or weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.numel() == 0 or not gemm_preferred()
            or weight.is_inference()):  # made under inference_mode: no version counter to see a change by
        return None
    key = (weight._version, weight.data_ptr())
    entry = _packed_weights.get(weight)
    if entry is None or entry[0] != key:
        entry = (key, RowProducts(weight, packed=True))
        _packed_weights[weight] = entry
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0])
    entry[1](rows, out, bias=None if bias is None else bias.contiguous())
    return out.view(*x.shape[:-1], weight.shape[0])


def unpack(weights) -> None:
    """Drop the packed copies of ``weights`` (an iterable of tensors) that :func:`packed_linear`
    keeps: their memory, and any copy PyTorch's version counter could not tell is stale."""
    for w in weights:
        _packed_weights.pop(w, None)


# ---- an inverted-residual block's expansion and depthwise convolution in one pass (conv.c) ----

def expand_depthwise_available() -> bool:
    """Does :func:`expand_depthwise` run conv.c here? Where the kernels load and were built with
    AVX2 and FMA."""
    return kernel_available() and bool(_load().expand_dw_supported())


def expand_depthwise(x: torch.Tensor, w_expand: torch.Tensor, b_expand: torch.Tensor, w_dw: torch.Tensor,
                     b_dw: torch.Tensor, stride: int, pads: tuple[int, int, int, int]) -> torch.Tensor | None:
    """relu6(depthwise(relu6(conv1x1(x, w_expand) + b_expand)) + b_dw) of ``x`` (N, C, H, W) in
    channels_last, by conv.c, without the expanded map ever whole in memory; the result (N, M,
    Ho, Wo) in channels_last. ``w_expand`` (M, C, 1, 1) and ``w_dw`` (M, 1, k, k) as nn.Conv2d
    holds them; ``pads`` (top, left, bottom, right) the expanded map's zeros ("SAME" padding).
    None where this is not the kernel's case (float32 CPU tensors, no gradient asked for, not
    traced or compiled, k 3 or 5, M a multiple of 24, the kernels built with AVX2 and FMA):
    the caller runs its own convolutions. It adds in the order oneDNN's convolutions add: their
    values bit for bit where measured (conv.c), tested to float32 rounding."""
    n, c, h, w = x.shape
    m, k = w_expand.shape[0], w_dw.shape[-1]
    if w_expand.shape != (m, c, 1, 1) or w_dw.shape != (m, 1, k, k) or b_expand.shape != (m,) or b_dw.shape != (m,):
        raise ValueError(f"expand_depthwise: weights {tuple(w_expand.shape)}, {tuple(w_dw.shape)} and biases "
                         f"{tuple(b_expand.shape)}, {tuple(b_dw.shape)} are not a {c} -> M expansion and an M-channel "
                         "depthwise convolution")
    if (torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling()
            or any(t.dtype != torch.float32 or t.device.type != KERNEL_DEVICE for t in (x, w_expand, b_expand, w_dw, b_dw))
            or not x.is_contiguous(memory_format=torch.channels_last) or k not in (3, 5) or m % 24
            or not expand_depthwise_available()):
        return None
    top, left, bottom, right = pads
    ho, wo = (h + top + bottom - k) // stride + 1, (w + left + right - k) // stride + 1
    we = w_expand.reshape(m, c).t().contiguous()  # (C, M)
    wd = w_dw.reshape(m, k * k).t().contiguous()  # (k*k, M)
    y = torch.empty(n, m, ho, wo, memory_format=torch.channels_last)
    rc = _load().expand_dw(_ptr(x), n, h, w, c, _ptr(we), _ptr(b_expand.contiguous()), _ptr(wd),
                           _ptr(b_dw.contiguous()), m, k, stride, top, left, ho, wo, _ptr(y), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("expand_depthwise: conv.c could not allocate its row buffers")
    if rc != 0:
        raise RuntimeError(f"expand_depthwise: conv.c refused k={k}, M={m} ({rc}), which the checks above admit")
    return y
