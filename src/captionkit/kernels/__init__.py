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

_SRC = Path(__file__).with_name("attention.c")
_lib = None
_tried = False
_plain = 0  # > 0 inside ``plain_pytorch()``


def _load():
    """Compile (once per source, machine and compiler) and load the C kernel, or None."""
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
    key = hashlib.sha1(_SRC.read_bytes() + " ".join([cc, platform.machine(), platform.node(), *compile_flags,
                                                     "|", *link_flags]).encode())
    so = cache_dir("kernels") / f"attention-{key.hexdigest()[:12]}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        obj = tmp[:-3] + ".o"
        r = subprocess.run([cc, *compile_flags, str(_SRC), "-o", obj], capture_output=True, text=True)
        if r.returncode == 0:
            r = subprocess.run([cc, *link_flags, obj, "-o", tmp, "-lm"], capture_output=True, text=True)
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
    lib.attn_energy_fwd.argtypes = [P, P, P, P, L_, L_, L_, I]
    lib.attn_energy_bwd.argtypes = [P, P, P, P, P, P, P, L_, L_, L_, I]
    lib.attn_energy_bwd.restype = I
    _lib = lib
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


def _fwd(lib, proj, q, w) -> torch.Tensor:
    B, L, A = proj.shape
    e = torch.empty(B, L, dtype=torch.float32)
    lib.attn_energy_fwd(_ptr(proj), _ptr(q), _ptr(w), _ptr(e), B, L, A, torch.get_num_threads())
    return e


def energy_forward(proj: torch.Tensor, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The C kernel's energy, no autograd: (B, L, A), (B, A), (A,) -> (B, L). For callers
    that write their own backward (the SAT decoder's fused recurrence); only where
    ``kernel_available()`` and ``_check`` hold."""
    return _fwd(_load(), proj, q, w)


def energy_backward(ge: torch.Tensor, proj: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                    gproj: torch.Tensor, gq: torch.Tensor, gw: torch.Tensor) -> None:
    """The C kernel's backward of :func:`energy_forward` for ge (B, L): adds into gproj
    (B, L, A) and gw (A,), writes gq (B, A). All float32 and contiguous."""
    B, L, A = proj.shape
    if _load().attn_energy_bwd(_ptr(ge), _ptr(proj), _ptr(q), _ptr(w), _ptr(gproj), _ptr(gq), _ptr(gw),
                               B, L, A, torch.get_num_threads()) != 0:
        raise MemoryError("attention kernel could not allocate its buffer")


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
        rc = _load().attn_energy_bwd(_ptr(ge.contiguous().float()), _ptr(proj), _ptr(q), _ptr(w),
                                     _ptr(ctx.buf), _ptr(gq), _ptr(gw), B, L, A, torch.get_num_threads())
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
