"""The device checks of tests/devicecheck.py catch what they promise, and pass clean code."""

import pytest
import torch
from devicecheck import META, MetaAnswers, count_syncs, factory_sentinel, hot_path, strict_devices


def test_strict_devices_refuses_what_meta_lets_through():
    m, c = torch.zeros(3, 2, device=META), torch.zeros(2, 4)
    torch.mm(m, c)  # meta alone lets this through; CUDA would not
    with strict_devices(), pytest.raises(AssertionError, match="'mm'.*2 devices"):
        torch.mm(m, c)
    with strict_devices(), pytest.raises(AssertionError, match="index_select"):
        m.index_select(0, torch.tensor([0, 1]))
    with strict_devices(), pytest.raises(AssertionError, match="'cat'"):
        torch.cat([m, torch.zeros(1, 2)])  # nested in a list
    with strict_devices(), pytest.raises(AssertionError, match="non-blocking copy"):
        m.to("cpu", non_blocking=True)
    with strict_devices(), pytest.raises(AssertionError, match="generator"):
        torch.multinomial(torch.ones(2, 3, device=META), 1, generator=torch.Generator())


def test_strict_devices_allows_what_cuda_allows():
    m = torch.zeros(3, 2, device=META)
    with strict_devices():
        m * torch.tensor(2.0)  # a 0-dim CPU tensor is a scalar
        m[torch.tensor([0, 2])]  # CPU indices of a device tensor
        m.to("cpu")
        torch.zeros(3, 2).copy_(m.to("cpu"))
        m[0] = torch.ones(2)  # setitem copies


def test_meta_reads_get_made_up_values():
    m = torch.zeros(2, 3, device=META)
    with strict_devices(MetaAnswers(fill=2)):
        assert m.sum().item() == 2.0 and int(m[0, 0].long()) == 2 and bool(m.any())
        assert m.long().tolist() == [[2, 2, 2], [2, 2, 2]]
        assert m.cpu().device.type == "cpu" and m.to("cpu").shape == (2, 3)
        assert m.numpy().shape == (2, 3) and f"{m[0, 0]:.1f}" == "2.0"
        assert m.nonzero().shape == (0, 2) and m.nonzero().device == META
    with strict_devices(MetaAnswers(truth=False, nonzero="all")):
        assert not bool(m.any()) and m.nonzero().shape == (6, 2)
        assert m.nonzero().tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]  # its own indices
        assert m[m > 0].shape == (6,)  # a bool mask selects what nonzero says
        assert torch.zeros(2, 3).copy_(m).shape == (2, 3)
        assert not torch.is_autocast_enabled("meta")  # meta answers autocast queries as fp32 devices
    calls = MetaAnswers(nonzero=lambda i, t: "all" if i == 1 else "empty")
    with strict_devices(calls):
        assert [len(m.nonzero()) for _ in range(3)] == [0, 6, 0]


def test_factory_sentinel():
    with factory_sentinel(META):
        torch.zeros(2, device=META)
        torch.zeros_like(torch.zeros(2, device=META))
        torch.tensor([1.0, 2.0], device="meta")  # host data, by design allowed
        for bad in (lambda: torch.zeros(2), lambda: torch.arange(3, device="cpu"),
                    lambda: torch.tensor([1, 2]).to(META), lambda: torch.ones(3).to(META)):
            with pytest.raises(AssertionError, match="hot path"):
                bad()
    with factory_sentinel(META, strict_data=True), pytest.raises(AssertionError, match="host data"):
        torch.tensor([1.0, 2.0], device="meta")


def _loop(x):
    for _ in range(3):
        if not x.any():  # one sync per pass
            break
        x.sum().item()  # and another
    return x.tolist()


def test_count_syncs_per_site_in_any_order():
    m = torch.zeros(4, device=META)
    for order in ("count inside", "count outside"):
        with (strict_devices() if order == "count inside" else count_syncs()) as a, \
                (count_syncs() if order == "count inside" else strict_devices()) as b:
            _loop(m)
        syncs = b if order == "count inside" else a
        assert syncs.total == 7, (order, syncs.report())
        assert {op for _, op in syncs.sites} == {"__bool__", "item", "tolist"}
        assert all(site.startswith("test_devicecheck.py:") for site in syncs.by_site())
    with count_syncs() as cpu_syncs:
        _loop(torch.ones(4))
    assert cpu_syncs.total == 0  # the CPU is not the device under test
    with count_syncs(devices=("cpu",)) as cpu_syncs:
        _loop(torch.ones(4))
    assert cpu_syncs.total == 7


def test_hot_path_scopes_a_mode_to_one_method():
    class Stepper:
        def step(self):
            return torch.zeros(2)

    s = Stepper()
    with hot_path(Stepper, "step", lambda: factory_sentinel(META)):
        torch.zeros(2)  # outside the hot path
        with pytest.raises(AssertionError, match="without device"):
            s.step()
    assert s.step().shape == (2,) and "step" not in vars(s)
    with hot_path(s, "step", lambda: factory_sentinel(META)), pytest.raises(AssertionError):
        s.step()
    assert "step" not in vars(s)


def _meta_of(out):
    if isinstance(out, torch.Tensor):
        return (out.device, tuple(out.shape), out.stride(), out.storage_offset(), out.dtype, out.requires_grad)
    return tuple(_meta_of(o) for o in out)


def test_the_meta_memo_gives_what_torch_gives_and_still_raises():
    """strict_devices remembers functional meta kernels' outputs (devicecheck's "Speed"): a second
    call of each op, memoised, gives tensors of the metadata torch's own kernel gives (a fresh
    one each time, gradients too), a call that raises raises every time, and views and in-place
    ops still alias their inputs."""
    import devicecheck
    from torch.nn import functional as F

    x = torch.empty(3, 4, 8, device=META).transpose(0, 1)  # (4, 3, 8), not contiguous
    w, b = torch.empty(5, 8, device=META, requires_grad=True), torch.empty(5, device=META, requires_grad=True)
    n = torch.empty(8, device=META)
    ops = [lambda: x + n, lambda: x * 2.5, lambda: F.linear(x, w, b), lambda: F.layer_norm(x, (8,), n, n),
           lambda: torch.native_layer_norm(x, (8,), n, n, 1e-5), lambda: x.softmax(-1), lambda: x.half() / 3,
           lambda: torch.cat([x, x], 1), lambda: (x > 0).sum(0), lambda: F.gelu(x).log_softmax(-1)]
    for op in ops:
        want = _meta_of(op())
        devicecheck._MEMO.clear()
        with strict_devices():
            first, second = op(), op()
        assert _meta_of(first) == _meta_of(second) == want
        assert devicecheck._MEMO, "nothing was memoised"
        assert second is not first
    with strict_devices():  # gradients flow through memoised ops as through torch's
        F.linear(x, w, b).sum().backward()
        F.linear(x, w, b).sum().backward()
    assert _meta_of(w.grad)[:5] == _meta_of(w)[:5] and _meta_of(b.grad)[:5] == _meta_of(b)[:5]
    for _ in range(2):  # a mismatch raises on every call, memoised or not
        with strict_devices(), pytest.raises(RuntimeError):
            torch.mm(torch.empty(2, 3, device=META), torch.empty(4, 5, device=META))
    with strict_devices():
        y = torch.empty(4, 3, 8, device=META)
        assert y.view(12, 8)._base is y and y[1:]._base is y and y.add_(1) is y
