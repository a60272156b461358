"""Mixed precision: a dynamic loss scaler with fused unscale + non-finite check kernels (C on the
CPU, CUDA on GPUs), a drop-in for ``torch.amp.GradScaler``.

Layers, bottom up: ``args`` (argument checks), ``launch`` (the C core's kernels), ``selfcheck``
(known-answer check of the kernels on a device), ``kernels`` (tensors to kernel calls, fallbacks to
torch's ops), ``cpu_unscale`` (the CPU fast path of ``unscale_``: the C walk over param_groups and
its protocol), ``visibility``, ``grad_scaler`` (the torch-compatible state machine).
"""

from llmmem.amp.grad_scaler import GradScaler, feature_status

__all__ = ["GradScaler", "feature_status"]
