"""GradScaler beyond plain, well-formed gradients and state: one section per case (tensor
subclasses, GPUs the build cannot run on, wrong state tensors, ...). CPU only."""

from __future__ import annotations

import re

import pytest
import torch

import llmmem
from llmmem import _scaler_kernels as K


# ------------------------------------------------------------------ GPUs the build cannot run on


@pytest.mark.parametrize("archs,cc,covered", [
    ("sm_80,sm_90,compute_90", (7, 5), False),   # T4: older than every arch, no PTX below it
    ("sm_75,sm_80,sm_90,compute_90", (7, 5), True),
    ("sm_80,sm_90,compute_90", (8, 6), True),    # sm_80 SASS runs on later minors of major 8
    ("sm_80,sm_90,compute_90", (8, 9), True),
    ("sm_80,sm_90,compute_90", (12, 0), True),   # only through the compute_90 PTX
    ("sm_80,sm_90", (12, 0), False),             # SASS never crosses majors
    ("sm_86", (8, 0), False),                    # nor runs on an older minor
    ("sm_80,compute_80", (9, 0), True),
    ("sm_90a", (9, 0), True),
    ("sm_90a", (10, 0), False),
    ("", (9, 0), False),
])
def test_archs_cover(archs, cc, covered):
    assert K._archs_cover(archs, cc) is covered


class _FakeNative:
    def __init__(self, archs, count=1, error=None):
        self.archs, self.count, self.error, self.calls = archs, count, error, 0

    def cuda_device_count(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.count

    def build_info(self):
        return {"cuda_built": True, "cuda_archs": self.archs}


@pytest.mark.parametrize("fake,cc,usable,why", [
    (_FakeNative("sm_80,sm_90,compute_90"), (7, 5), False, r"built for sm_80,sm_90,compute_90.*sm_75"),
    (_FakeNative("sm_75,sm_80,sm_90,compute_90"), (7, 5), True, None),
    (_FakeNative("sm_80,sm_90,compute_90", error=llmmem.NoDeviceError("no driver")), (9, 0), False,
     "cannot use the GPUs"),
    (_FakeNative("sm_80,sm_90,compute_90", count=0), (9, 0), False, r"sees 0 GPU\(s\)"),
])
def test_cuda_kernels_are_probed_once_per_device(monkeypatch, fake, cc, usable, why):
    monkeypatch.setattr(K, "native", fake)
    monkeypatch.setattr(K, "_cuda_built", True)
    monkeypatch.setattr(K, "_cuda_support", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cc)
    dev = torch.device("cuda", 0)
    assert K.uses_llmmem_kernels(dev) is usable
    assert K.uses_llmmem_kernels(dev) is usable
    assert fake.calls == 1  # the probe is cached: no driver call per step
    reason = K._kernel_unsupported_reason(dev)
    if why is None:
        assert reason is None
    else:
        assert reason is not None and re.search(why, reason), reason
