"""GradScaler beyond plain, well-formed gradients and state: one section per case (tensor
subclasses, GPUs the build cannot run on, wrong state tensors, ...). CPU only."""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch
from support.amp import FakeCudaNative

import llmmem
from llmmem import _cuda_build
from llmmem.amp import kernels as K

# ------------------------------------------------------------------ DTensor gradients


@pytest.fixture
def mesh(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.distributed.device_mesh import init_device_mesh

    # One rank, in this process: a FileStore needs no port and no spawned workers.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _dtensor_run(impl, mesh, poison=None, with_plain=False):
    from torch.distributed.tensor import Shard, distribute_tensor

    plain = torch.nn.Parameter(torch.full((3,), 2.0))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
    opt = torch.optim.SGD([plain, sharded] if with_plain else [sharded], lr=0.1)
    s = impl("cpu", init_scale=4.0)
    if with_plain:  # a separate loss: DTensor and plain tensors do not mix in one expression
        s.scale((plain * plain).sum()).backward()
    s.scale((sharded * sharded).sum()).backward()
    if poison == "sharded":
        sharded.grad.to_local()[1, 2] = float("inf")
    elif poison == "plain":
        plain.grad[0] = float("nan")
    s.step(opt)
    s.update()
    return s, opt, plain.detach().clone(), sharded.full_tensor().detach().clone()


@pytest.mark.parametrize("poison", [None, "sharded"])
def test_dtensor_gradients_match_torch(mesh, poison):
    t_s, _, _, t_sharded = _dtensor_run(torch.amp.GradScaler, mesh, poison)
    l_s, opt, _, l_sharded = _dtensor_run(llmmem.GradScaler, mesh, poison)
    assert torch.equal(l_sharded, t_sharded)
    assert l_s.get_scale() == t_s.get_scale() == (4.0 if poison is None else 2.0)
    assert l_s.overflowed_params(optimizer=opt) == ([(0, 0)] if poison else [])
    assert l_s.last_step_skipped() == (poison is not None)


@pytest.mark.parametrize("poison", [None, "sharded", "plain"])
def test_dtensor_and_plain_gradients_in_one_optimizer(mesh, poison):
    # torch's scaler hands both kinds to one torch op call, which DTensor rejects; here both go to
    # llmmem's kernel (the DTensor's local shard), and the DTensor's flag is agreed over the mesh.
    s, opt, plain, sharded = _dtensor_run(llmmem.GradScaler, mesh, poison, with_plain=True)
    if poison is None:  # grads 2 * 2 and 2 * 1, unscaled exactly, one SGD step of lr 0.1
        assert plain.tolist() == pytest.approx([1.6] * 3) and sharded.flatten().tolist() == pytest.approx([0.8] * 16)
    else:
        assert plain.tolist() == [2.0] * 3 and sharded.flatten().tolist() == [1.0] * 16
    # Each overflow is pinned on its own parameter: the kernel's flag slots and the DTensor
    # group's flags do not overwrite each other.
    assert s.overflowed_params(optimizer=opt) == {None: [], "sharded": [(0, 1)], "plain": [(0, 0)]}[poison]
    assert s.get_scale() == (4.0 if poison is None else 2.0)


# ------------------------------------------------------------------ GPUs the build cannot run on


@pytest.mark.parametrize(
    "archs,cc,covered",
    [
        ("sm_80,sm_90,compute_90", (7, 5), False),  # T4: older than every arch, no PTX below it
        ("sm_75,sm_80,sm_90,compute_90", (7, 5), True),
        ("sm_80,sm_90,compute_90", (8, 6), True),  # sm_80 SASS runs on later minors of major 8
        ("sm_80,sm_90,compute_90", (8, 9), True),
        ("sm_80,sm_90,compute_90", (12, 0), True),  # only through the compute_90 PTX
        ("sm_80,sm_90", (12, 0), False),  # SASS never crosses majors
        ("sm_86", (8, 0), False),  # nor runs on an older minor
        ("sm_80,compute_80", (9, 0), True),
        ("sm_90a", (9, 0), True),
        ("sm_90a", (10, 0), False),
        ("", (9, 0), False),
    ],
)
def test_archs_cover(archs, cc, covered):
    assert K._archs_cover(archs, cc) is covered


@pytest.mark.parametrize(
    "fake,cc,usable,why",
    [
        (FakeCudaNative("sm_80,sm_90,compute_90"), (7, 5), False, r"built for sm_80,sm_90,compute_90.*sm_75"),
        (FakeCudaNative("sm_75,sm_80,sm_90,compute_90"), (7, 5), True, None),
        (
            FakeCudaNative("sm_80,sm_90,compute_90", error=llmmem.NoDeviceError("no driver")),
            (9, 0),
            False,
            "cannot use the GPUs",
        ),
        (FakeCudaNative("sm_80,sm_90,compute_90", count=0), (9, 0), False, r"sees 0 GPU\(s\)"),
    ],
)
def test_cuda_kernels_are_probed_once_per_device(monkeypatch, fake, cc, usable, why):
    monkeypatch.setattr(_cuda_build, "native", fake)
    monkeypatch.setattr(_cuda_build, "_built", True)
    monkeypatch.setattr(K, "_cuda_support", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cc)
    monkeypatch.setattr(K, "_capturing", lambda: False)
    checked = []  # the fake has no kernels: the self-check (tests/test_amp_selfcheck.py) is stubbed as passing
    monkeypatch.setattr(K, "_self_check", lambda device: checked.append(device))
    dev = torch.device("cuda", 0)
    assert K.uses_llmmem_kernels(dev) is usable
    assert K.uses_llmmem_kernels(dev) is usable
    assert fake.calls == 1  # the probe is cached: no driver call per step
    assert checked == ([dev] if usable else [])  # the self-check runs last, once, only where all else passed
    reason = K._kernel_unsupported_reason(dev)
    if why is None:
        assert reason is None
    else:
        assert reason is not None and re.search(why, reason), reason


# ------------------------------------------------------------------ subclasses of GradScaler


def test_torch_style_unscale_grads_override_gets_the_inverse_scale_tensor():
    from torch.amp.grad_scaler import _MultiDeviceReplicator

    seen = []

    class TorchStyle(llmmem.GradScaler):  # written against torch's _unscale_grads_ contract
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            seen.append(inv_scale)
            inv, fi = _MultiDeviceReplicator(inv_scale), _MultiDeviceReplicator(found_inf)
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch._amp_foreach_non_finite_check_and_unscale_(grads, fi.get(grads[0].device), inv.get(grads[0].device))
            return fi._per_device_tensors

    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), 4.0)
    opt = torch.optim.SGD([p], lr=1.0)
    s = TorchStyle("cpu", init_scale=3.0)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    assert type(seen[0]) is torch.Tensor and seen[0].dtype == torch.float32
    assert seen[0].item() == torch.tensor(3.0).double().reciprocal().float().item()
    assert torch.equal(p.grad, torch.full((3,), 4.0) * seen[0])
    s.step(opt)
    s.update()
    assert s.get_scale() == 3.0


# ------------------------------------------------------------------ wrong state tensors


def test_float64_scale_unscales_like_torch_then_update_raises_torchs_error():
    results = []
    for impl, prefix in ((torch.amp.GradScaler, ""), (llmmem.GradScaler, r"llmmem\.GradScaler: ")):
        s = impl("cpu", growth_interval=1)
        s._scale = torch.tensor(1024.0, dtype=torch.float64)
        s._growth_tracker = torch.tensor(0, dtype=torch.int32)
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        s.step(torch.optim.SGD([p], lr=0.1))
        with pytest.raises(RuntimeError, match=f"^{prefix}current_scale must be a float tensor.$"):
            s.update()
        results.append(p.grad.clone())
    assert torch.equal(results[0], results[1])  # 1/1024, not a float64 read as float32


def test_int64_growth_tracker_raises_torchs_error():
    s = llmmem.GradScaler("cpu", growth_interval=3)
    s.scale(torch.ones(()))
    s._growth_tracker = torch.tensor(2**40, dtype=torch.int64)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    s.step(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(RuntimeError, match=r"^llmmem\.GradScaler: growth_tracker must be an int tensor\.$"):
        s.update()
    assert s._growth_tracker.item() == 2**40


def test_kernel_wrappers_check_tensors_before_taking_pointers():
    g = torch.ones(4)
    found = torch.zeros(())
    flags = torch.zeros(1, dtype=torch.uint8)
    scale = torch.tensor(2.0)
    bad = [
        (dict(found_inf=torch.zeros((), dtype=torch.float64)), "found_inf must be a float tensor."),
        (dict(found_inf=torch.zeros(2)), "found_inf must be a 1-element tensor."),
        (dict(found_inf=torch.zeros((), device="meta")), "found_inf must be on cpu"),
        (dict(flags=torch.zeros(1, dtype=torch.int32)), "flags must be a uint8 tensor."),
        (dict(flags=torch.zeros(0, dtype=torch.uint8)), "flags must be a 1-element tensor."),
        (dict(scale=torch.tensor([2.0, 2.0])), "inv_scale must be a 1-element tensor."),
        (dict(scale=torch.tensor(0.5, dtype=torch.float64), scale_is_inverse=True), "inv_scale must be a float"),
    ]
    for override, msg in bad:
        kw = dict(found_inf=found, flags=flags, scale=scale, scale_is_inverse=False) | override
        with pytest.raises(RuntimeError, match=msg):
            K.unscale_check_([g], **kw)
    assert g.tolist() == [1.0] * 4 and found.item() == 0.0
    st = (
        torch.tensor(8.0),
        torch.zeros((), dtype=torch.int32),
        torch.ones((), dtype=torch.int32),
        torch.zeros(4, dtype=torch.int64),
    )
    cases = [
        ((st[0], st[1], st[2], torch.zeros(3, dtype=torch.int64)), [found], "stats must be a 4-element tensor."),
        ((st[0], st[1], st[2].long(), st[3]), [found], "hysteresis_tracker must be an int tensor."),
        (st, [found.double()], "found_inf must be a float tensor."),
        ((st[0], torch.zeros(2, dtype=torch.int32), st[2], st[3]), [found], "growth_tracker must be a 1-element"),
    ]
    for state, founds, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            K.update_scale_(*state, founds, 2.0, 0.5, 10, 1, 0.0)
    assert st[0].item() == 8.0 and st[3].tolist() == [0, 0, 0, 0]


# ------------------------------------------------------------------ misaligned gradients


@pytest.mark.parametrize("poison", [False, True])
def test_misaligned_gradient_is_processed_in_place_like_torch(poison):
    out = []
    for impl in (torch.amp.GradScaler, llmmem.GradScaler):
        buf = bytearray(4 * 9)
        g = torch.frombuffer(buf, dtype=torch.float32, offset=1, count=8)
        assert g.data_ptr() % 4 != 0
        g.copy_(torch.arange(8, dtype=torch.float32))
        if poison:
            g[5] = float("inf")
        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = g
        q = torch.nn.Parameter(torch.zeros(2))
        q.grad = torch.ones(2)
        opt = torch.optim.SGD([q, p], lr=1.0)
        s = impl("cpu", init_scale=4.0)
        s.scale(torch.ones(()))
        s.unscale_(opt)
        assert p.grad is g  # the caller's tensor (and buffer) holds the result
        out.append(torch.frombuffer(bytearray(buf), dtype=torch.float32, offset=1, count=8))
        s.step(opt)
        s.update()
        if impl is llmmem.GradScaler:
            assert s.overflowed_params() == ([(0, 1)] if poison else [])
    assert torch.equal(out[0].nan_to_num(), out[1].nan_to_num())


# ------------------------------------------------------------------ lifetime


def test_scaler_does_not_keep_a_deleted_model_alive():
    s = llmmem.GradScaler("cpu")
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s.scale(m(torch.randn(2, 64)).sum()).backward()
    m.weight.grad[0, 0] = float("inf")
    s.step(opt)
    s.update()
    assert s.overflowed_params(m) == ["weight"]  # the record still works while the model lives
    w, wg = weakref.ref(m.weight), weakref.ref(m.weight.grad)
    del m, opt
    gc.collect()
    assert w() is None and wg() is None
    assert s.overflowed_params() == []  # the deleted optimizer's record is simply gone
