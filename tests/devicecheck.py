"""Device checks for CPU-only CI: see on the CPU the device bugs that only a GPU would show.

Nothing here needs a GPU. The trick is the ``meta`` device: a model and its inputs moved to
``torch.device("meta")`` behave like a second device (shapes and dtypes, no data), so code that
mixes a "GPU" tensor with a CPU one, builds tensors on the wrong device, or reads device values
on the host can be caught. Three tools, each a context manager around a
:class:`torch.overrides.TorchFunctionMode` (every torch function and tensor method call made
inside the ``with`` block goes through it):

``strict_devices()``
    Raises ``AssertionError`` naming the op when one call gets tensors on more than one device
    (0-dim CPU tensors excepted: CUDA takes those as scalars). Needed because meta is more
    lenient than CUDA: ``torch.mm(meta, cpu)`` and ``meta.index_select(0, cpu_idx)`` succeed on
    meta and crash on CUDA. It also *answers* host reads of meta tensors (``item``, ``tolist``,
    ``bool(t)``, ``float(t)``, ``.cpu()``, ``.to("cpu")``, ``.numpy()``, ``nonzero``...), which meta
    cannot do, with made-up values (:class:`MetaAnswers`), so whole decoding and training loops
    run on meta.

``factory_sentinel(device)``
    Fails any tensor factory (``zeros``, ``full``, ``arange``, ``tensor``, ``randn``...) called
    without ``device=``, or with a device other than ``device`` (the device under test), and
    any host->device copy of a non-scalar CPU tensor. Meant for hot paths only (a decoding
    step, a training step, SCST sampling), where each such call costs a host->device copy per
    step, or creates a CPU tensor that then meets a device one. See the rules below.

``count_syncs(devices)``
    Counts host syncs (reads of device values on the host) per call site: the first frame in
    ``src/captionkit`` (else the first frame outside torch and this file). ``report()`` gives a
    table; ``total`` the count; ``sites`` a ``Counter`` of ``(site, op)``.

Typical use::

    model = model.to("meta")
    feats = torch.rand(2, 6, 8, device="meta")
    with strict_devices(MetaAnswers(fill=Vocab.end)), count_syncs() as syncs:
        with factory_sentinel(torch.device("meta")):
            greedy(model, feats, max_len=5)
    assert syncs.total <= 6, syncs.report()

``meta_models.decoding_answers(max_len)`` (tests/meta_models.py) gives the answers decoding
loops need; :func:`hot_path` scopes a mode to one method (``Trainer.train_step``, ``model.step``).

Speed. torch runs most operators on the meta device through its Python reference kernels
(``torch._refs``, ``torch._decomp``): 0.5-5 ms a call where the CPU takes microseconds (measured:
``a + b`` 850 us, ``F.layer_norm`` 5 ms). Inside ``strict_devices`` a dispatch mode
(:class:`MetaMemo`) remembers what each functional operator gave for meta inputs of the same
metadata (shapes, strides, offsets, dtypes, the other arguments, the default dtype) and gives
the same again, as fresh tensors, without running the kernel: a meta kernel's output depends on
nothing else. Views, in-place and ``out=`` operators, random ones and those whose output depends
on data always run, and so does every call that raises (nothing is remembered of it).

Limits. A mode sees the calls made inside its block through torch's Python API; the ops *inside*
a torch function it has already seen (``F.cross_entropy``'s own, say) are not seen again, and
neither is C++ code. Syncs that torch's CUDA code makes by itself (``torch.cuda.synchronize``,
a blocking copy from pageable memory, caching-allocator frees) are not counted. Other
data-dependent ops on meta (``unique``, ``masked_select``, ``repeat_interleave`` with tensor
repeats) are counted as syncs but not answered: meta raises, loudly.

Order of nesting. Modes nest like function calls: the *innermost* (last entered) sees a call
first. ``count_syncs`` and ``strict_devices`` both answer meta host reads; whichever answers
tells every active counter, so counts are right in any order. ``factory_sentinel`` only looks.

What the factory sentinel allows and refuses (inside its block):

* refused: a factory (``torch.zeros/ones/full/empty/empty_strided/arange/range/linspace/
  logspace/eye/rand/randn/randint/randperm/normal/tensor/as_tensor/asarray/scalar_tensor/
  tril_indices/triu_indices``) without ``device=``, or with a device that is not the one under
  test. ``torch.tensor(ids).to(device)`` is refused too: it is a pageable host->device copy
  every step; build the tensor on the device, or keep the data on the device.
* refused: ``torch.from_numpy`` (always a CPU tensor) and ``.to(device)``/``.cuda()``/
  ``copy_`` of a CPU tensor with more than one element onto the device under test (a
  host->device copy per step; pass ``host_copies=True`` where one is by design, e.g. a training
  step that moves its batch).
* allowed: ``zeros_like``/``full_like``/``new_zeros``/... (they inherit the device), and
  ``torch.tensor(data, device=device)`` with ``device`` the device under test: host data (say,
  rewards scored on the CPU) has to travel once; ``strict_data=True`` refuses that too (but for
  empty data, ``torch.tensor([], device=d)``: nothing travels), as decoding steps should.
* allowed: 0-dim CPU tensors (Python scalars wrapped by torch) - CUDA takes them as scalars.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["META", "MetaAnswers", "MetaMemo", "SyncCounter", "count_syncs", "factory_sentinel", "hot_path",
           "meta_autocast", "strict_devices", "tensor_devices"]

CPU = torch.device("cpu")
META = torch.device("meta")
_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SRC = os.sep + os.path.join("src", "captionkit") + os.sep


# ---- walking arguments ---------------------------------------------------------------------------
def _tensors(obj) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` and its nested lists/tuples/dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _generators(obj) -> Iterator[torch.Generator]:
    if isinstance(obj, torch.Generator):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _generators(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _generators(o)


def _is_cpu_scalar(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 0


def tensor_devices(args, kwargs) -> set[torch.device]:
    """The devices of the tensors among ``args``/``kwargs``, 0-dim CPU tensors left out."""
    return {t.device for t in _tensors((args, kwargs)) if not _is_cpu_scalar(t)}


def _name(func) -> str:
    return getattr(func, "__name__", None) or repr(func)


def _to_target(args, kwargs) -> tuple[torch.device | None, torch.dtype | None, bool]:
    """(device, dtype, non_blocking) of a ``Tensor.to(...)`` call."""
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                          if k != "copy"})
    return device, dtype, non_blocking


# ---- answering host reads of meta tensors --------------------------------------------------------
# Ops that read a tensor's values on the host (and so, on CUDA, wait for the GPU: a sync).
_SCALAR_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "__complex__", "__format__"}
_ARRAY_READS = {"tolist", "numpy", "__array__", "cpu"}
_SIZE_READS = {"nonzero", "argwhere"}  # output shape depends on the values (nonzero_static's does not)
_COMPARE_READS = {"equal", "allclose"}  # a Python bool from two tensors


@dataclass
class MetaAnswers:
    """The made-up values a host read of a meta tensor returns.

    fill: every number read (``item``, ``tolist``, ``.cpu()``...) is this value, cast to the
    tensor's dtype. Decoding tests use ``Vocab.end`` so that word lists contain an <end>.
    truth: what ``bool(t)``, ``torch.equal`` and ``allclose`` say. ``True`` makes loops of the
    form ``if not alive.any(): break`` run to ``max_len`` (and ``if done.all(): break`` stop at
    once: pick what the loop under test needs).
    nonzero: what ``nonzero``/``argwhere`` give: ``"empty"`` (no element is true: the shape a
    data-dependent op cannot know on meta, so none), ``"all"`` (every element is true), or a
    callable ``(call_number, tensor) -> "empty" | "all"`` (e.g. empty until the last decoding
    step, where every beam candidate is an <end>, as on a real run)."""
    fill: int | float = 0
    truth: bool = True
    nonzero: str | Callable[[int, torch.Tensor], str] = "empty"
    _nonzero_calls: int = field(default=0, repr=False)
    # the values of the meta tensors made up here (nonzero's indices), read back as they are
    _known: dict = field(default_factory=dict, repr=False)

    def _remember(self, t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        key = id(t)
        self._known[key] = (weakref.ref(t), values)
        weakref.finalize(t, self._known.pop, key, None)
        return t

    def value(self, dtype: torch.dtype):
        if dtype == torch.bool:
            return bool(self.fill)
        if dtype.is_floating_point or dtype.is_complex:
            return float(self.fill)
        return int(self.fill)

    def host_tensor(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or t.dtype
        ref, values = self._known.get(id(t), (None, None))
        if ref is not None and ref() is t:
            return values.to(dtype)
        return torch.full(t.shape, self.value(dtype), dtype=dtype, device=CPU)

    def nonzero_of(self, t: torch.Tensor, as_tuple: bool = False):
        kind = self.nonzero
        if callable(kind):
            kind = kind(self._nonzero_calls, t)
        self._nonzero_calls += 1
        if kind == "all":
            idx = torch.ones(t.shape, dtype=torch.bool).nonzero()  # (numel, dim), every index
        elif kind == "empty":
            idx = torch.zeros((0, t.dim()), dtype=torch.long)
        else:
            raise ValueError(f"MetaAnswers.nonzero must be 'empty', 'all' or a callable, not {kind!r}")
        # a meta result, as nonzero of a device tensor is a device tensor; its values are kept
        # for when they are read (nonzero().tolist())
        if as_tuple:
            return tuple(self._remember(torch.empty(len(idx), dtype=torch.long, device=t.device), col)
                         for col in idx.unbind(1))
        return self._remember(torch.empty(idx.shape, dtype=torch.long, device=t.device), idx)


_NOT_A_READ = object()


def _is_meta_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.device.type == "meta"


def _answer_meta_read(answers: MetaAnswers, name: str, args, kwargs):
    """The made-up result of a host read of a meta tensor, or ``_NOT_A_READ``."""
    if not args or not isinstance(args[0], torch.Tensor):
        if name in _COMPARE_READS and any(t.device.type == "meta" for t in _tensors((args, kwargs))):
            return answers.truth
        return _NOT_A_READ
    t = args[0]
    if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].device.type == "meta" \
            and t.device.type == "cpu":  # cpu_tensor.copy_(meta_tensor): the made-up values written in
        return t.copy_(answers.host_tensor(args[1], t.dtype))
    if t.device.type != "meta":
        return _NOT_A_READ
    if name == "__bool__":
        return answers.truth
    if name in ("item", "__float__", "__int__", "__index__", "__complex__"):
        if t.numel() != 1:  # the real error, not a made-up value
            raise RuntimeError(f"{name}: a Tensor with {t.numel()} elements cannot be converted to Scalar")
        v = answers.value(t.dtype)
        return {"__float__": float, "__int__": int, "__index__": int, "__complex__": complex}.get(name, lambda x: x)(v)
    if name == "__format__":
        v = answers.value(t.dtype) if t.dim() == 0 else t
        return format(v, *args[1:]) if t.dim() == 0 else object.__format__(t, *args[1:])
    if name == "tolist":
        return answers.host_tensor(t).tolist()
    if name in ("numpy", "__array__"):
        return answers.host_tensor(t).numpy()
    if name == "cpu":
        return answers.host_tensor(t)
    if name == "to":
        device, dtype, _ = _to_target(args, kwargs)
        if device is not None and device.type == "cpu":
            return answers.host_tensor(t, dtype)
        return _NOT_A_READ
    if name in ("nonzero", "argwhere"):
        return answers.nonzero_of(t, bool(kwargs.get("as_tuple", False)))
    if name == "__getitem__" and len(args) > 1 and _is_meta_mask(args[1]):
        # x[mask]: as many rows as nonzero says the mask holds (a new tensor: no autograd link)
        mask = args[1]
        rows = len(answers.nonzero_of(mask))
        return t.new_empty((rows, *t.shape[mask.dim():]))
    if name in _COMPARE_READS:
        return answers.truth
    return _NOT_A_READ



# Active sync counters, so that a meta read answered by any mode is counted once by each.
_COUNTERS: list[SyncCounter] = []


_ANSWERERS: list[MetaAnswers] = []  # those of the active strict_devices blocks


def _notify_read(label: str, t: torch.Tensor) -> None:
    for c in _COUNTERS:
        if c._counts(t):
            c._record(label)


# ---- strict_devices ------------------------------------------------------------------------------
# Ops whose job is to move data between devices, or that take CPU indices for device tensors
# (as CUDA does): they may see two devices.
_CROSS_DEVICE_OK = {"to", "cpu", "cuda", "copy_", "__set__", "__get__", "set_", "type", "new_tensor",
                    "tensor", "as_tensor", "asarray", "_has_compatible_shallow_copy_type", "__setitem__",
                    "__reduce_ex__", "__deepcopy__", "detach", "requires_grad_", "pin_memory"}
_INDEXING = {"__getitem__", "index", "index_put", "index_put_"}


def _check_devices(name: str, args, kwargs) -> None:
    if name == "to" and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
        device, _, non_blocking = _to_target(args, kwargs)
        if non_blocking and device is not None and device.type == "cpu":
            raise AssertionError(f"a non-blocking copy from {args[0].device} to the CPU: its values may be read "
                                 "before they land (synchronize first, or copy blocking)")
    if name in _CROSS_DEVICE_OK:
        return
    devices = tensor_devices(args, kwargs)
    if name in _INDEXING and args and isinstance(args[0], torch.Tensor):
        # CUDA tensors take CPU index tensors (they are copied); a CPU tensor refuses CUDA indices
        devices = {args[0].device} | {d for d in devices if d.type != "cpu"}
    if len(devices) > 1:
        raise AssertionError(f"torch op {name!r} got tensors on {len(devices)} devices "
                             f"({', '.join(sorted(map(str, devices)))}): CUDA refuses this")
    gens = list(_generators((args, kwargs)))
    if gens and devices:
        (device,) = devices
        for g in gens:
            if g.device.type != device.type:
                raise AssertionError(f"torch op {name!r} on {device} got a generator on {g.device}: "
                                     "CUDA refuses a generator of another device")


class _StrictDevices(TorchFunctionMode):
    def __init__(self, answers: MetaAnswers):
        super().__init__()
        self.answers = answers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name != "__get__":  # attribute reads (.shape, .device, .grad) are the hot case
            _check_devices(name, args, kwargs)
            answer = _answer_meta_read(self.answers, name, args, kwargs)
            if answer is not _NOT_A_READ:
                t, label = _sync_tensor(name, args, kwargs)
                _notify_read(label or name, args[0] if t is None else t)
                return answer
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_autocast():
    """``torch.is_autocast_enabled("meta")`` raises (meta has no autocast), where code that asks
    of a CUDA or CPU device gets an answer: inside, meta answers as a device whose autocast is off
    (what fp32 runs see). Entered by :func:`strict_devices`."""
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def is_enabled(*args):
        if args and str(args[0]) == "meta":
            return False
        return enabled(*args)

    def get_dtype(device_type):
        return torch.float32 if str(device_type) == "meta" else dtype(device_type)

    torch.is_autocast_enabled, torch.get_autocast_dtype = is_enabled, get_dtype
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype = enabled, dtype


# ---- memoised meta kernels (see "Speed" above) ------------------------------------------------
_MEMO: dict = {}
_MEMO_MAX = 200_000  # entries; cleared when full (a whole suite's decoding shapes fit many times)
_MEMOISABLE: dict = {}  # op -> whether its outputs are fresh tensors that depend on metadata only


class _NotMeta(Exception):
    pass


def _memoisable(func) -> bool:
    schema = func._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return False  # in place, out=, views: their outputs are (or alias) their inputs
    return not ({torch.Tag.nondeterministic_seeded, torch.Tag.data_dependent_output} & set(func.tags))


def _meta_key(obj, tensors: list):
    """``obj``'s metadata as a hashable key; _NotMeta for a tensor off meta or an argument whose
    effect this cannot tell (a generator, say)."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" or type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise _NotMeta  # (a subclass may carry what the metadata does not show)
        tensors.append(obj)
        return ("T", tuple(obj.shape), obj.stride(), obj.storage_offset(), obj.dtype)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_meta_key(o, tensors) for o in obj))
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format,
                                       torch.layout)):
        return (type(obj).__name__, obj)
    raise _NotMeta


def _out_spec(out):
    if type(out) is torch.Tensor:
        return ("T", tuple(out.shape), out.stride(), out.dtype) if out.is_meta and out.storage_offset() == 0 else None
    if isinstance(out, (tuple, list)):
        parts = [_out_spec(o) for o in out]
        return None if any(p is None for p in parts) else (type(out), parts)
    return None


def _from_spec(spec):
    if spec[0] == "T":
        _, shape, stride, dtype = spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=META)
    kind, parts = spec
    return kind(_from_spec(p) for p in parts)


class MetaMemo(TorchDispatchMode):
    """The memo of "Speed" in the module's doc: below autograd, so gradients are recorded (and
    computed, by the same memo) as without it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ok = _MEMOISABLE.get(func)
        if ok is None:
            ok = _MEMOISABLE[func] = _memoisable(func)
        if not ok:
            return func(*args, **kwargs)
        tensors: list = []
        try:
            key = (func, torch.get_default_dtype(), _meta_key(args, tensors),
                   _meta_key(tuple(sorted(kwargs.items())), tensors))
        except _NotMeta:
            return func(*args, **kwargs)
        if not tensors:  # a factory: cheap, and its device is what the sentinel checks
            return func(*args, **kwargs)
        spec = _MEMO.get(key)
        if spec is not None:
            return _from_spec(spec)
        out = func(*args, **kwargs)
        spec = _out_spec(out)
        if spec is not None:
            if len(_MEMO) >= _MEMO_MAX:
                _MEMO.clear()
            _MEMO[key] = spec
        return out


@contextlib.contextmanager
def strict_devices(answers: MetaAnswers | None = None):
    """Inside: any torch call on tensors of two devices raises AssertionError (see the module's
    doc), and host reads of meta tensors get the made-up values of ``answers``; meta answers
    autocast queries (:func:`meta_autocast`). Yields the :class:`MetaAnswers` in use."""
    answers = answers or MetaAnswers()
    _ANSWERERS.append(answers)
    try:
        with meta_autocast(), _StrictDevices(answers), MetaMemo():
            yield answers
    finally:
        _ANSWERERS.remove(answers)


# ---- factory_sentinel ----------------------------------------------------------------------------
_FACTORIES = {"zeros", "ones", "full", "empty", "empty_strided", "arange", "range", "linspace", "logspace", "eye",
              "rand", "randn", "randint", "randperm", "normal", "tensor", "as_tensor", "asarray", "scalar_tensor",
              "tril_indices", "triu_indices", "from_numpy"}
_DATA_FACTORIES = {"tensor", "as_tensor", "asarray"}


def _caller() -> str:
    """file:line of the first frame in src/captionkit, else of the first outside torch and here."""
    fallback = None
    for fs in reversed(traceback.extract_stack()):
        path = os.path.abspath(fs.filename)
        if path == _HERE or path.startswith(_TORCH_DIR) or "contextlib" in path:
            continue
        if _SRC in path:
            return f"captionkit/{path.split(_SRC, 1)[1]}:{fs.lineno}"
        fallback = fallback or f"{os.path.basename(path)}:{fs.lineno}"
    return fallback or "?"


def _is_empty_data(data) -> bool:
    """``torch.tensor([])``: nothing to copy (how caches start empty)."""
    return isinstance(data, (list, tuple)) and len(data) == 0


def _same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 are one device when one of them names no index."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class _FactorySentinel(TorchFunctionMode):
    def __init__(self, device: torch.device | None, host_copies: bool, strict_data: bool):
        super().__init__()
        self.device, self.host_copies, self.strict_data = device, host_copies, strict_data

    def _refuse(self, why: str):
        raise AssertionError(f"{why} (at {_caller()}) inside a hot path: see tests/devicecheck.py")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in _FACTORIES and not hasattr(torch.Tensor, name):
            if name == "from_numpy":
                self._refuse("torch.from_numpy makes a CPU tensor")
            device = kwargs.get("device")
            if device is None and name in _DATA_FACTORIES and args and isinstance(args[0], torch.Tensor):
                device = args[0].device  # as_tensor(t) keeps t where it is
            elif device is None and name == "normal" and any(isinstance(a, torch.Tensor) for a in args):
                device = next(a for a in args if isinstance(a, torch.Tensor)).device  # normal(mean, std)
            if device is None:
                self._refuse(f"torch.{name} without device=")
            device = torch.device(device)
            if self.device is not None and not _same_device(device, self.device):
                self._refuse(f"torch.{name} on {device}, the device under test is {self.device}")
            if self.strict_data and name in _DATA_FACTORIES and not (args and _is_empty_data(args[0])):
                self._refuse(f"torch.{name} of host data (a host->device copy)")
        elif not self.host_copies and args and isinstance(args[0], torch.Tensor):
            self._check_copy(name, args, kwargs)
        return func(*args, **kwargs)

    def _check_copy(self, name, args, kwargs):
        t = args[0]
        if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            src = args[1]
            if src.device.type == "cpu" and t.device.type != "cpu" and src.numel() > 1:
                self._refuse(f"copy_ of a CPU tensor {tuple(src.shape)} to {t.device}")
            return
        if t.device.type != "cpu" or t.numel() <= 1:
            return
        if name == "cuda":
            self._refuse(f"host->device copy of a CPU tensor {tuple(t.shape)}")
        if name == "to":
            device, _, _ = _to_target(args, kwargs)
            if device is not None and device.type != "cpu":
                self._refuse(f".to({device}) of a CPU tensor {tuple(t.shape)}: a host->device copy")


@contextlib.contextmanager
def factory_sentinel(device: torch.device | str | None = None, host_copies: bool = False,
                     strict_data: bool = False):
    """Inside: tensor factories must name ``device=`` (and, given ``device``, that device), and
    CPU tensors must not be copied to the device (unless ``host_copies``). See the module's doc."""
    with _FactorySentinel(None if device is None else torch.device(device), host_copies, strict_data):
        yield


# ---- count_syncs ---------------------------------------------------------------------------------
@dataclass
class SyncCounter:
    """Host syncs seen inside a :func:`count_syncs` block."""
    devices: tuple[str, ...] | None  # device types counted; None: every device but the CPU
    sites: Counter = field(default_factory=Counter)  # (site, op) -> count

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def by_site(self) -> Counter:
        out: Counter = Counter()
        for (site, _), n in self.sites.items():
            out[site] += n
        return out

    def report(self, per: int = 1, unit: str = "") -> str:
        """One line per (site, op), most first; ``per`` divides the counts (e.g. by steps)."""
        lines = [f"{self.total / per:8.2f}  total{unit}"]
        for (site, op), n in self.sites.most_common():
            lines.append(f"{n / per:8.2f}  {site}  {op}")
        return "\n".join(lines)

    def reset(self) -> None:
        self.sites.clear()

    def _counts(self, t: torch.Tensor) -> bool:
        if self.devices is None:
            return t.device.type != "cpu"
        return t.device.type in self.devices

    def _record(self, op: str) -> None:
        self.sites[(_caller(), op)] += 1


def _sync_tensor(name: str, args, kwargs) -> tuple[torch.Tensor | None, str]:
    """(the device tensor read on the host, op label) if this call is a host sync, else (None, '')."""
    if not args:
        return None, ""
    t = args[0]
    if name in _COMPARE_READS:
        ts = [x for x in _tensors((args, kwargs))]
        return (ts[0] if ts else None), name
    if not isinstance(t, torch.Tensor):
        return None, ""
    if name in _SCALAR_READS or name in _ARRAY_READS or name in _SIZE_READS:
        return t, name
    if name == "to":
        device, _, non_blocking = _to_target(args, kwargs)
        if device is not None and device.type == "cpu":
            return t, "to(cpu, non_blocking)" if non_blocking else "to(cpu)"
    if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and t.device.type == "cpu":
        return args[1], "copy_ to cpu"
    if name in ("__getitem__", "index", "index_put_", "index_put", "__setitem__", "masked_select", "unique",
                "repeat_interleave", "bincount", "unique_consecutive"):
        if name in ("masked_select", "unique", "unique_consecutive"):
            return t, name
        if name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and args[1].numel() > 1 and kwargs.get("output_size") is None:
            return args[1], "repeat_interleave(tensor repeats)"
        if name == "bincount" and not kwargs.get("minlength"):
            return t, name
        idx = args[1] if len(args) > 1 else None
        for i in _tensors(idx):
            if i.dtype == torch.bool and i.device.type != "cpu":
                return i, f"{name}[bool mask]"
    return None, ""


class _CountSyncs(TorchFunctionMode):
    def __init__(self, counter: SyncCounter, answers: MetaAnswers | None):
        super().__init__()
        self.counter, self.answers = counter, answers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name != "__get__":
            t, label = _sync_tensor(name, args, kwargs)
            if t is not None and t.device.type == "meta":
                # answered here (given answers, or no strict_devices around), else by the
                # strict_devices further out, which tells the counters: counted once either way
                if self.answers is not None or not _ANSWERERS:
                    answer = _answer_meta_read(self.answers or MetaAnswers(), name, args, kwargs)
                    if answer is not _NOT_A_READ:
                        _notify_read(label, t)
                        return answer
            elif t is not None and self.counter._counts(t):
                self.counter._record(label)
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_syncs(devices: tuple[str, ...] | None = None, answers: MetaAnswers | None = None):
    """Counts host syncs on tensors of ``devices`` (device types; default every device but the
    CPU, so a meta model stands in for a GPU) inside the block; yields the :class:`SyncCounter`.
    Meta reads are answered by the :func:`strict_devices` around (its answers), else by
    ``answers`` (default :class:`MetaAnswers`)."""
    counter = SyncCounter(devices)
    _COUNTERS.append(counter)
    try:
        with _CountSyncs(counter, answers):
            yield counter
    finally:
        _COUNTERS.remove(counter)


# ---- scoping a mode to one method ----------------------------------------------------------------
@contextlib.contextmanager
def hot_path(obj: Any, name: str, *modes: Callable[[], Any]):
    """Within the block, every call of ``obj.name`` (an instance's method, or a class's: then
    for every instance) runs inside fresh instances of ``modes`` (context-manager factories,
    e.g. ``lambda: factory_sentinel("meta")``), so a check covers a hot path only, not the
    setup around it::

        with hot_path(Trainer, "train_step", lambda: factory_sentinel("meta", host_copies=True)):
            trainer.fit(...)
    """
    own = vars(obj).get(name, _MISSING)
    inner = getattr(obj, name)  # a bound method of an instance, or a class's plain function

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for make in modes:
                stack.enter_context(make())
            return inner(*args, **kwargs)

    setattr(obj, name, wrapped)
    try:
        yield
    finally:
        if own is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


_MISSING = object()
