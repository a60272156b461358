"""Model state in less memory: Adam/AdamW with moments in bf16, 8 or 4 bits, bf16 weights updated
without an fp32 master (stochastic rounding), and the step taken inside backward.

    opt = llmmem.optim.AdamW(model.parameters(), lr=3e-4, state_dtype="int8")
    handle = llmmem.optim.step_in_backward(model, opt)   # handle.remove() to undo
"""

from llmmem.optim.adamw import Adam, AdamW
from llmmem.optim.in_backward import StepInBackward, step_in_backward
from llmmem.optim.kernels import feature_status

__all__ = ["Adam", "AdamW", "StepInBackward", "feature_status", "step_in_backward"]
