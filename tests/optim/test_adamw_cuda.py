"""The optimizer's CUDA step: its known-answer check (run on the CPU here, where it checks the
vector step, and with a broken kernel, which it must catch), the fallback to the reference where
the kernels do not run, and on a GPU the CUDA step against the C reference bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

import llmmem.optim as lo
from llmmem._native import native
from llmmem.optim import cuda, kernels


def test_self_check_passes_on_the_cpu_step():
    assert cuda.self_check(torch.device("cpu")) is None


def test_self_check_catches_a_kernel_that_is_off_by_one_bit():
    import ctypes

    def broken(records, *args, **kwargs):
        native.optim_adamw_step(records, *args, **kwargs)
        for rec in records:  # flip the lowest bit of the first weight of every tensor
            cell = (ctypes.c_uint32 if rec[9] == 0 else ctypes.c_uint16).from_address(rec[0])
            cell.value ^= 1

    why = cuda.self_check(torch.device("cpu"), step=broken)
    assert why is not None and "known-answer check" in why and "p of" in why, why


@pytest.mark.parametrize(
    "broken_when",
    [
        pytest.param(
            lambda rec, block: block == 256, id="int8's default block (a quantization block per thread block)"
        ),
        pytest.param(lambda rec, block: block > 256, id="blocks of several elements a thread"),
        pytest.param(lambda rec, block: rec[9] == 1, id="fp16 weights with a master"),
    ],
)
def test_self_check_covers_the_paths_the_cuda_kernel_takes(broken_when):
    import ctypes

    def broken(records, *args, **kwargs):
        native.optim_adamw_step(records, *args, **kwargs)
        for rec in records:
            if broken_when(rec, args[8]):
                cell = (ctypes.c_uint32 if rec[9] == 0 else ctypes.c_uint16).from_address(rec[0])
                cell.value ^= 1

    why = cuda.self_check(torch.device("cpu"), step=broken)
    assert why is not None and "known-answer check" in why, why


def test_self_check_reports_a_kernel_that_raises():
    def failing(*args, **kwargs):
        raise RuntimeError("no kernel image for this GPU")

    why = cuda.self_check(torch.device("cpu"), step=failing)
    assert why is not None and "could not run" in why and "no kernel image" in why


def test_devices_without_kernels_fall_back_to_the_reference_with_one_warning(monkeypatch):
    p = torch.nn.Parameter(torch.randn(300))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad, q.grad = torch.ones(300), torch.ones(300)
    # the CPU stands in for a device the kernels do not cover
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setattr(kernels, "native_route", lambda device: "no kernels here (simulated)")
    opt = lo.AdamW([p], lr=0.1, seed=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
        opt.step()
    assert sum("llmmem.optim" in str(w.message) for w in seen) == 1
    monkeypatch.undo()
    ref = lo.AdamW([q], lr=0.1, seed=1)
    ref.step()
    ref.step()
    assert torch.equal(p, q)  # the reference gives the kernel's answer


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype,master", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_cuda_step_equals_the_cpu_step(fmt, dtype, master):
    assert cuda.unsupported_reason(torch.device("cuda")) is None
    torch.manual_seed(0)
    sizes = (1, 33, 4097, 70001, 1 << 20)
    cpu = [torch.nn.Parameter((torch.randn(n) * 2).to(dtype)) for n in sizes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    kw = dict(lr=1e-2, state_dtype=fmt, min_quantized_numel=32, master_weights=master, seed=3)
    oc, og = lo.AdamW(cpu, **kw), lo.AdamW(gpu, **kw)
    for _ in range(3):
        for a, b in zip(cpu, gpu):
            g = (torch.randn(a.shape) * torch.logspace(-5, 1, a.numel())).to(dtype)
            a.grad, b.grad = g, g.cuda()
        oc.step()
        og.step()
    torch.cuda.synchronize()
    for a, b in zip(cpu, gpu):
        assert cuda.same_bits(a.detach(), b.detach().cpu())
        for key, t in oc.state[a].items():
            if isinstance(t, torch.Tensor):
                assert cuda.same_bits(t, og.state[b][key].cpu()), key


def _reference_against_c(device):
    """The torch-ops reference run on ``device`` against the C reference on the CPU, two steps."""
    from llmmem.optim import formats, reference
    from llmmem.optim.kernels import Hyper

    hp = Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, True, False, True)
    for fmt in (
        formats.Format("fp32"),
        formats.Format("bf16"),
        formats.Format("int8", 256),
        formats.Format("int4", 64),
    ):
        for n in (33, 5000):
            gen = torch.Generator().manual_seed(n)
            w = torch.randn(n, generator=gen)
            st = {"step": torch.zeros(()), **formats.new_moments(fmt, w)}
            mine = {k: v.clone() for k, v in st.items()}
            p_c, p_ref = w.clone(), w.to(device)
            ref_state = {k: (v.to(device) if k != "step" else v) for k, v in mine.items()}
            for _ in range(2):
                g = torch.randn(n, generator=gen) * torch.logspace(-4, 1, n)
                item = kernels.Item(param=p_c, grad=g, master=None, state=st, seed=5)
                kernels._step_native([item], fmt, hp, torch.device("cpu"))
                tensors = {"param": p_ref, "grad": g.to(device), "master": None, "seed": 5, **ref_state}
                reference.adamw_step(tensors, fmt, hp.as_dict())
            assert cuda.same_bits(p_c, p_ref.cpu()), (fmt, n)
            for k in st:
                assert cuda.same_bits(st[k], ref_state[k].cpu()), (fmt, n, k)


def test_the_reference_equals_the_c_step_on_the_cpu():
    _reference_against_c("cpu")


@pytest.mark.cuda
def test_the_reference_equals_the_c_step_on_a_gpu():
    # torch's CUDA division by a CPU scalar multiplies by its reciprocal (one bit off at times):
    # the reference divides by a tensor on the device instead
    _reference_against_c("cuda")
