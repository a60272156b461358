"""Every warning and error of llmmem.GradScaler names llmmem.GradScaler (not torch's class or
module), and every warning points at the user's line (its stacklevel)."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import llmmem

NAME = "llmmem.GradScaler"


def _line_after(marker: str) -> int:
    """The line number of the statement tagged ``# <marker>`` in this file."""
    with open(__file__) as fh:
        return next(i for i, line in enumerate(fh, 1) if line.rstrip().endswith(f"# {marker}"))


def _only(rec, category):
    found = [w for w in rec if issubclass(w.category, category)]
    assert len(found) == 1, [str(w.message) for w in rec]
    return found[0]


def _check_points_here(w, marker: str) -> None:
    text = str(w.message)
    assert text.startswith(NAME), text
    assert "torch.cuda.amp" not in text and "torch.amp" not in text, text
    assert w.filename == __file__, w.filename
    assert w.lineno == _line_after(marker)


def test_cuda_missing_warning_names_llmmem_and_points_at_the_caller():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        scaler = llmmem.GradScaler("cuda")  # cuda-missing
    _check_points_here(_only(rec, UserWarning), "cuda-missing")
    assert not scaler.is_enabled()


class _LegacyAmpOptimizer(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        return "stepped"


def test_legacy_optimizer_future_warning_names_llmmem_and_points_at_the_caller():
    model = torch.nn.Linear(3, 2)
    opt = _LegacyAmpOptimizer(model.parameters(), lr=0.1)
    scaler = llmmem.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        scaler.step(opt)  # legacy-step
    _check_points_here(_only(rec, FutureWarning), "legacy-step")


def test_min_scale_warning_names_llmmem_and_points_at_the_caller():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = llmmem.GradScaler("cpu", init_scale=4.0, min_scale=2.0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            scaler.scale(model(torch.ones(1, 4)).sum() * float("inf")).backward()
            scaler.step(opt)
            scaler.update()  # min-scale
            opt.zero_grad()
    _check_points_here(_only(rec, RuntimeWarning), "min-scale")


def _misuses():
    def fresh():
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = llmmem.GradScaler("cpu")
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        return model, opt, scaler

    def unscale_twice():
        _, opt, s = fresh()
        s.unscale_(opt)
        s.unscale_(opt)

    def unscale_after_step():
        _, opt, s = fresh()
        s.step(opt)
        s.unscale_(opt)

    def step_twice():
        _, opt, s = fresh()
        s.step(opt)
        s.step(opt)

    def closure():
        _, opt, s = fresh()
        s.step(opt, closure=lambda: None)

    def update_before_scale():
        llmmem.GradScaler("cpu").update()

    def fp16_grads():
        p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        p.grad = torch.ones(2, dtype=torch.float16)
        s = llmmem.GradScaler("cpu")
        s.scale(torch.ones(()))
        s.unscale_(torch.optim.SGD([p], lr=0.1))

    def bad_outputs():
        llmmem.GradScaler("cpu").scale("loss")

    def empty_state():
        llmmem.GradScaler("cpu").load_state_dict({})

    def pickled_mid_iteration():
        _, opt, s = fresh()
        s.unscale_(opt)
        pickle.dumps(s)

    def bad_new_scale():
        _, opt, s = fresh()
        s.step(opt)
        s.update(torch.ones(2))

    def float64_scale():
        _, opt, s = fresh()
        s._scale = s._scale.double()
        s.step(opt)
        s.update()

    def bad_setting():
        llmmem.GradScaler("cpu", growth_factor=0.5)

    return [unscale_twice, unscale_after_step, step_twice, closure, update_before_scale, fp16_grads, bad_outputs,
            empty_state, pickled_mid_iteration, bad_new_scale, float64_scale, bad_setting]  # fmt: skip


@pytest.mark.parametrize("misuse", _misuses(), ids=lambda f: f.__name__)
def test_every_error_names_llmmem_grad_scaler(misuse):
    with pytest.raises(Exception) as info:  # the type is torch's (checked elsewhere); the words ours
        misuse()
    text = str(info.value).strip("'\"")
    assert text.startswith(NAME), text
