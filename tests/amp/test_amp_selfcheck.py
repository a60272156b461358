"""The known-answer self-check of the loss-scaler kernels (llmmem/_scaler_selfcheck.py), run here
on the CPU: llmmem's CPU kernel must pass it, deliberately broken kernels must fail it with a
reason naming what differed, and a failed check must make the scaler fall back to torch's ops
with a single warning. (On a GPU, tests/test_amp_cuda.py runs it on the CUDA kernels.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from support.amp import FakeCudaNative

from llmmem import _cuda_build
from llmmem.amp import kernels as K
from llmmem.amp import launch as L
from llmmem.amp import selfcheck as S

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _need_core():
    from llmmem._native import available

    if not available():
        pytest.skip("llmmem's C core is not loaded")


def test_cpu_kernels_pass():
    assert S.self_check(CPU) is None


def test_default_entry_points_are_the_real_paths(monkeypatch):
    """The check drives the same launchers as unscale_check_ / update_scale_."""
    seen = []
    real_unscale, real_update = L.launch_unscale, L.launch_update
    monkeypatch.setattr(L, "launch_unscale", lambda *a: (seen.append("unscale"), real_unscale(*a))[1])
    monkeypatch.setattr(L, "launch_update", lambda *a: (seen.append("update"), real_update(*a))[1])
    assert S.self_check(CPU) is None
    assert seen.count("unscale") == 3 and seen.count("update") == len(S._UPDATES)


def test_check_leaves_no_state_behind():
    rng_state = torch.get_rng_state()
    threads = torch.get_num_threads()
    assert S.self_check(CPU) is None
    assert torch.equal(torch.get_rng_state(), rng_state)  # its own generator only
    assert torch.get_num_threads() == threads


def _flip_one_element(grads, found_inf, flags, scale, scale_is_inverse):
    L.kernel_unscale(grads, found_inf, flags, scale, scale_is_inverse)
    for g in grads:
        if g.dtype == torch.float16 and g.numel() == 4097 and g.data_ptr() % g.element_size() == 0:
            bits = g.view(torch.int16)
            bits[100] ^= 1  # one ulp off
            return


def _miss_nan(grads, found_inf, flags, scale, scale_is_inverse):
    """A kernel blind to NaN: values are right, the NaN is not flagged."""
    holes = [torch.isnan(g) for g in grads]
    for g, h in zip(grads, holes):
        g[h] = 0
    L.kernel_unscale(grads, found_inf, flags, scale, scale_is_inverse)
    for g, h in zip(grads, holes):
        g[h] = float("nan")


def _skip_second_chunk(grads, found_inf, flags, scale, scale_is_inverse):
    """A kernel that stops after the first 65536 elements of each tensor."""
    L.kernel_unscale([g[:65536] for g in grads], found_inf, flags, scale, scale_is_inverse)


def _ignore_flags(grads, found_inf, flags, scale, scale_is_inverse):
    L.kernel_unscale(grads, found_inf, None, scale, scale_is_inverse)


def _raises(grads, found_inf, flags, scale, scale_is_inverse):
    raise RuntimeError("an illegal memory access was encountered")


def _fp32_rounding(grads, found_inf, flags, scale, scale_is_inverse):
    """Rounds fp16/bf16 results twice (through fp32 then an fp16 multiply), as a kernel computing
    in the storage type would."""
    if scale is None:
        return L.kernel_unscale(grads, found_inf, flags, scale, scale_is_inverse)
    inv = scale if scale_is_inverse else scale.double().reciprocal().float()
    L.kernel_unscale(grads, found_inf, flags, None, False)  # flags only
    for g in grads:
        g.copy_(g * inv.to(g.dtype))


@pytest.mark.parametrize(
    "broken,expect",
    [
        (
            _flip_one_element,
            r"unscale float16 size 4097: element 100 expected .*\(0x[0-9a-f]{4}\), got .*\(0x[0-9a-f]{4}\)"
            r"; 1 element",
        ),
        (_miss_nan, r"overflow flag of float16 size 70001 with nan at 35000: expected 1, got 0"),
        (_skip_second_chunk, r"unscale float32 size 70001: element 65536"),
        (_ignore_flags, r"overflow flag of float32 size 4097 with \+inf at 0: expected 1, got 0"),
        (_raises, r"RuntimeError: an illegal memory access"),
        (_fp32_rounding, r"unscale (float16|bfloat16) size"),
    ],
)
def test_broken_unscale_kernels_are_caught(broken, expect):
    import re

    why = S.self_check(CPU, unscale=broken)
    assert why is not None and re.search(expect, why), why
    assert why.startswith("llmmem's kernels failed their self-check on cpu")


def _no_growth(scale, growth, hyst, stats, found_infs, gf, bf, interval, hysteresis, min_scale, on_growth):
    """Compares the tracker with > instead of == (never grows at the interval)."""
    L.launch_update(scale, growth, hyst, stats, found_infs, gf, bf, interval + 1, hysteresis, min_scale, on_growth)


def _backoff_in_fp32(scale, growth, hyst, stats, found_infs, gf, bf, interval, hysteresis, min_scale, on_growth):
    """Multiplies by the factor rounded to fp32 (torch multiplies in double)."""
    L.launch_update(
        scale,
        growth,
        hyst,
        stats,
        found_infs,
        gf,
        float(torch.tensor(bf, dtype=torch.float32)),
        interval,
        hysteresis,
        min_scale,
        on_growth,
    )


def _first_flag_only(scale, growth, hyst, stats, found_infs, gf, bf, interval, hysteresis, min_scale, on_growth):
    L.launch_update(scale, growth, hyst, stats, found_infs[:1], gf, bf, interval, hysteresis, min_scale, on_growth)


@pytest.mark.parametrize(
    "broken,expect",
    [
        (_no_growth, r"scale update \(growth: scale 1024.0, tracker 1"),
        (_backoff_in_fp32, r"scale update \(backoff by an inexact factor: scale 65535.0.*expected scale.* 24247.95"),
        (_first_flag_only, r"scale update \(backoff by an inexact factor"),
    ],
)
def test_broken_update_kernels_are_caught(broken, expect):
    import re

    why = S.self_check(CPU, update=broken)
    assert why is not None and re.search(expect, why), why


@pytest.fixture
def fake_gpu(monkeypatch):
    """cuda:0 probed as usable up to the self-check, which runs on the CPU with the kernel under
    test; CPU tensors then stand in for that GPU's gradients (their device is routed to the probe)."""
    monkeypatch.setattr(_cuda_build, "native", FakeCudaNative("sm_90", real=_cuda_build.native))
    monkeypatch.setattr(_cuda_build, "_built", True)
    monkeypatch.setattr(K, "_cuda_support", {})
    monkeypatch.setattr(K, "_warned_fallback", set())
    monkeypatch.setattr(K, "_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    calls = []

    def use(unscale=None):
        def check(device):
            calls.append(device)
            return S.self_check(CPU, unscale=unscale)

        monkeypatch.setattr(K, "_self_check", check)
        # CPU gradients take the GPU's verdict (the C kernel stays what runs them when it is positive)
        monkeypatch.setattr(K, "_kernel_unsupported_reason", lambda device: K._cuda_unsupported_reason(0))
        return calls

    return use


def test_probe_runs_the_check_once_and_caches_a_pass(fake_gpu):
    calls = fake_gpu()
    assert K._cuda_unsupported_reason(0) is None
    assert K._cuda_unsupported_reason(0) is None
    assert calls == [torch.device("cuda", 0)]


def test_failed_check_falls_back_to_torch_with_one_warning(fake_gpu):
    calls = fake_gpu(unscale=_flip_one_element)
    found = torch.zeros(())
    flags = torch.zeros(2, dtype=torch.uint8)
    grads = [torch.full((4097,), 3.0, dtype=torch.float16), torch.tensor([1.0, float("nan")])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        K.unscale_check_(grads, found, flags, torch.full((), 2.0))
        K.unscale_check_([torch.ones(5)], torch.zeros(()), None, torch.full((), 2.0))
        st, gt = torch.full((), 8.0), torch.zeros((), dtype=torch.int32)
        K.update_scale_(
            st,
            gt,
            torch.ones((), dtype=torch.int32),
            torch.zeros(4, dtype=torch.int64),
            [found],
            2.0,
            0.5,
            100,
            1,
            0.0,
        )
    ours = [w for w in caught if "llmmem.GradScaler" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    msg = str(ours[0].message)
    assert "failed their self-check" in msg and "float16 size 4097: element 100" in msg and "torch's" in msg
    assert calls == [torch.device("cuda", 0)]  # checked once, the verdict cached
    # torch's ops did the work, correctly
    assert torch.equal(grads[0], torch.full((4097,), 1.5, dtype=torch.float16))
    assert float(found) == 1.0 and flags.tolist() == [0, 1]
    assert float(st) == 4.0 and int(gt) == 0


def test_first_use_inside_graph_capture_is_not_cached(fake_gpu, monkeypatch):
    calls = fake_gpu()
    monkeypatch.setattr(K, "_capturing", lambda: True)
    why = K._cuda_unsupported_reason(0)
    assert why is not None and "capture" in why
    assert calls == [] and 0 not in K._cuda_support
    monkeypatch.setattr(K, "_capturing", lambda: False)
    assert K._cuda_unsupported_reason(0) is None
    assert calls == [torch.device("cuda", 0)]
