"""The CUDA kernels against the C reference (bitwise, every dtype including bf16, which torch's
CUDA op rejects), against torch's CUDA op, the device-side update against the host rule, parity
of GradScaler("cuda") with torch's on a fused-AdamW run, and a training step with zero host
synchronisations. All marked `cuda`: they run on a lent GPU and skip elsewhere."""

from __future__ import annotations

import random

import pytest
import torch

import llmmem
from llmmem._native import native
from llmmem.amp import kernels as K
from llmmem.amp import launch as L

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SPECIALS = [float("inf"), float("-inf"), float("nan")]


@pytest.fixture(autouse=True)
def _need_kernels():
    if not K.cuda_kernels_built():
        pytest.skip("llmmem was built without its CUDA kernels")


def rand_grads(count, seed, max_numel=300_000):
    """(bases, starts, poisoned): gradient i is bases[i][starts[i]:]; a start of 1 makes a
    misaligned view, which takes the kernel's scalar path (slice after moving to the device)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bases, starts, poisoned = [], [], set()
    for i in range(count):
        n = rng.choice([0, 1, 7, 4097, 65536, 65537, rng.randint(1, max_numel)])
        g = (torch.randn(n, generator=gen, dtype=torch.float64) * 2.0 ** rng.randint(-10, 10)).to(rng.choice(DTYPES))
        start = 1 if n > 8 and rng.random() < 0.2 else 0
        if n - start and rng.random() < 0.1:
            g[start + rng.choice([0, (n - start) // 2, n - start - 1])] = rng.choice(SPECIALS)
            poisoned.add(i)
        bases.append(g)
        starts.append(start)
    return bases, starts, poisoned


def assert_bitwise_or_both_nan(a, b):
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a[~nan_a].view(ints), b[~nan_b].view(ints))


@pytest.mark.parametrize("count,seed", [(1, 0), (7, 1), (150, 2), (1000, 3), (2500, 4)])
@pytest.mark.parametrize("scale", [65536.0, 0.75])
def test_kernel_matches_c_reference(count, seed, scale):
    bases, starts, poisoned = rand_grads(count, seed, max_numel=300_000 if count < 500 else 5000)
    cpu = [b.clone()[s:] for b, s in zip(bases, starts)]
    dev = [b.cuda()[s:] for b, s in zip(bases, starts)]
    assert any(d.data_ptr() % 16 for d in dev) or count < 10
    found_c, flags_c = torch.zeros(()), torch.zeros(count, dtype=torch.uint8)
    K.unscale_check_(cpu, found_c, flags_c, torch.full((), scale))
    found_d = torch.zeros((), device="cuda")
    flags_d = torch.zeros(count, dtype=torch.uint8, device="cuda")
    K.unscale_check_(dev, found_d, flags_d, torch.full((), scale, device="cuda"))
    assert found_d.item() == found_c.item() == float(bool(poisoned))
    assert torch.equal(flags_d.cpu(), flags_c)
    assert {i for i, f in enumerate(flags_c.tolist()) if f} == poisoned
    for a, b in zip(dev, cpu):
        assert_bitwise_or_both_nan(a.cpu(), b)


def test_large_tensor_and_torch_op():
    g = torch.randn(10**6 + 3, device="cuda") * 1000
    g[-1] = float("nan")
    ours, ref = g.clone(), g.clone()
    f1, f2 = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    scale = torch.full((), 1024.0, device="cuda")
    K.unscale_check_([ours], f1, None, scale)
    torch._amp_foreach_non_finite_check_and_unscale_([ref], f2, scale.double().reciprocal().float())
    assert f1.item() == f2.item() == 1.0
    assert_bitwise_or_both_nan(ours.cpu(), ref.cpu())


def test_check_only_writes_nothing():
    g = torch.randn(200_000, device="cuda", dtype=torch.bfloat16)
    g[77] = float("inf")
    before = g.clone()
    found = torch.zeros((), device="cuda")
    K.unscale_check_([g], found, None, None)
    assert found.item() == 1.0 and torch.equal(g.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("hysteresis,min_scale,on_growth", [(1, 0.0, False), (3, 2.0, False), (3, 2.0, True)])
def test_device_update_follows_host_rule(hysteresis, min_scale, on_growth):
    rng = random.Random(hysteresis)
    host = [
        torch.full((), 512.0),
        torch.zeros((), dtype=torch.int32),
        torch.full((), hysteresis, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int64),
    ]
    dev = [t.cuda() for t in host]
    for _ in range(300):
        flags = [float(rng.random() < 0.4), 0.0]
        K.update_scale_(*host, [torch.full((), f) for f in flags], 2.0, 0.5, 3, hysteresis, min_scale, on_growth)
        K.update_scale_(
            *dev, [torch.full((), f, device="cuda") for f in flags], 2.0, 0.5, 3, hysteresis, min_scale, on_growth
        )
    for h, d in zip(host, dev):
        assert torch.equal(h, d.cpu())


def _run(impl, steps=60):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    s = impl("cuda", init_scale=2.0**12, growth_interval=4)
    traj = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).cuda()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        s.scale(loss).backward()
        if step % 9 == 4:
            model[0].weight.grad[0, 0] = float("inf")
        s.step(opt)
        s.update()
        traj.append((s.get_scale(), s._get_growth_tracker()))
    return traj, model


def test_cuda_scaler_same_run_as_torch_with_fused_adamw():
    t_traj, t_model = _run(torch.amp.GradScaler)
    l_traj, l_model = _run(llmmem.GradScaler)
    assert l_traj == t_traj
    for a, b in zip(t_model.parameters(), l_model.parameters()):
        assert torch.equal(a, b)


def test_bf16_gradients_on_cuda():
    model = torch.nn.Linear(16, 4).cuda().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = llmmem.GradScaler("cuda", init_scale=64.0)
    s.scale(model(torch.ones(2, 16, device="cuda", dtype=torch.bfloat16)).float().sum()).backward()
    ref = model.weight.grad.float().cpu() / 64.0
    s.unscale_(opt)
    assert torch.equal(model.weight.grad.cpu(), ref.to(torch.bfloat16))
    s.step(opt)
    s.update()
    assert s.skipped_steps() == 0


def test_fused_training_step_never_synchronises():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    s = llmmem.GradScaler("cuda")
    x = torch.randn(16, 32, device="cuda")
    for step in range(3):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            s.scale(loss).backward()
            s.unscale_(opt) if step == 2 else None
            s.step(opt)
            s.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert s.stats()["updates"] == 3


def test_min_scale_warning_arrives_without_a_sync():
    model = torch.nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = llmmem.GradScaler("cuda", init_scale=4.0, min_scale=2.0)
    with pytest.warns(RuntimeWarning, match="min_scale=2.0"):
        for _ in range(8):
            s.scale(model(torch.ones(1, 4, device="cuda")).sum()).backward()
            model.weight.grad[0, 0] = float("inf")
            s.step(opt)
            s.update()
            torch.cuda.synchronize()  # lets the polled copy land; the scaler itself never waits
    assert s._scale.item() == 2.0


def test_overflow_names_on_cuda():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = llmmem.GradScaler("cuda")
    s.scale(model(torch.ones(1, 4, device="cuda")).sum()).backward()
    model[1].weight.grad[0, 1] = float("nan")
    s.step(opt)
    s.update()
    assert s.overflowed_params(model) == ["1.weight"] and s.last_step_skipped()


def test_cuda_entry_checks_arguments():
    found = torch.zeros((), device="cuda")
    with pytest.raises(llmmem.InvalidArgumentError, match="device"):
        native.scaler_unscale_check_cuda([found.data_ptr()], [1], [0], 0, False, found.data_ptr(), 0, 0, -1, 0)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernels_restore_the_callers_current_device():
    # The kernels switch to the gradients' device; the caller's current device must come back
    # afterwards, or the caller's later work would land on the scaler's device.
    torch.cuda.set_device(0)
    g = torch.ones(8, device="cuda:1")
    found = torch.zeros((), device="cuda:1")
    scale = torch.full((), 4.0, device="cuda:1")
    stream = torch.cuda.current_stream(1).cuda_stream
    native.scaler_unscale_check_cuda(
        [g.data_ptr()], [8], [0], scale.data_ptr(), False, found.data_ptr(), 0, 0, 1, stream
    )
    assert torch.cuda.current_device() == 0
    growth = torch.zeros((), dtype=torch.int32, device="cuda:1")
    native.scaler_update(
        scale.data_ptr(), growth.data_ptr(), 0, 0, [found.data_ptr()], 2.0, 0.5, 10, 1, 0.0, 1, stream
    )
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert g.cpu().tolist() == [0.25] * 8 and scale.item() == 4.0


def test_build_covers_this_gpu_and_the_probe_says_so():
    # The probe that routes unsupported GPUs to torch's ops must not route a covered one there.
    cc = torch.cuda.get_device_capability(0)
    assert K._archs_cover(native.build_info()["cuda_archs"], cc)
    assert K.uses_llmmem_kernels(torch.device("cuda", 0))


# ------------------------------------------------------------------ the self-check at first use


def _flip_one_fp16_element(grads, found_inf, flags, scale, scale_is_inverse):
    L.kernel_unscale(grads, found_inf, flags, scale, scale_is_inverse)
    for g in grads:
        if g.dtype == torch.float16 and g.numel() == 4097 and g.data_ptr() % 16 == 0:
            g.view(torch.int16)[100] ^= 1
            return


def test_self_check_passes_on_this_gpu_without_extra_syncs():
    from llmmem.amp.selfcheck import self_check

    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(0)
    torch.cuda.set_sync_debug_mode("error")  # its one read is exempt; anything else would raise
    try:
        assert self_check(torch.device("cuda", last)) is None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.current_device() == 0  # the current device is restored
    assert K._cuda_unsupported_reason(0) is None  # the cached probe, self-check included, passed


def test_self_check_catches_a_broken_kernel_on_gpu():
    from llmmem.amp.selfcheck import self_check

    why = self_check(torch.device("cuda", 0), unscale=_flip_one_fp16_element)
    assert why is not None and "float16 size 4097: element 100" in why, why


def test_scaler_falls_back_to_torch_when_the_self_check_fails(monkeypatch):
    from llmmem.amp.selfcheck import self_check

    monkeypatch.setattr(K, "_cuda_support", {})
    monkeypatch.setattr(K, "_warned_fallback", set())
    monkeypatch.setattr(K, "_self_check", lambda device: self_check(device, unscale=_flip_one_fp16_element))
    model = torch.nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = llmmem.GradScaler("cuda", init_scale=1024.0)
    s.scale(model(torch.ones(1, 4, device="cuda")).sum()).backward()
    with pytest.warns(RuntimeWarning, match="failed their self-check.*float16 size 4097"):
        s.unscale_(opt)
    assert torch.equal(model.weight.grad, torch.ones(2, 4, device="cuda"))  # unscaled by torch's op
    s.step(opt)
    s.update()
    assert not K.uses_llmmem_kernels(torch.device("cuda", 0))
