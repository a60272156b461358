"""Misuse of the scaler: the same exceptions and messages as torch.amp.GradScaler where torch has
them (one test body run against both), and clear ValueError/TypeError for the settings torch
does not check."""

from __future__ import annotations

import pytest
import torch

import llmmem

IMPLS = {"torch": torch.amp.GradScaler, "llmmem": llmmem.GradScaler}


@pytest.fixture(params=list(IMPLS))
def impl(request):
    return IMPLS[request.param]


def setup(impl, dtype=torch.float32):
    model = torch.nn.Linear(3, 2).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = impl("cpu")
    scaler.scale(model(torch.ones(1, 3, dtype=dtype)).float().sum()).backward()
    return model, opt, scaler


def test_unscale_twice(impl):
    _, opt, s = setup(impl)
    s.unscale_(opt)
    with pytest.raises(
        RuntimeError,
        match=r"unscale_\(\) has already been called on this optimizer since the last "
        r"update\(\)\.",
    ):
        s.unscale_(opt)


def test_unscale_after_step(impl):
    _, opt, s = setup(impl)
    s.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)\."):
        s.unscale_(opt)


def test_step_twice(impl):
    _, opt, s = setup(impl)
    s.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)\."):
        s.step(opt)


def test_closure_rejected(impl):
    _, opt, s = setup(impl)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported if GradScaler is enabled."):
        s.step(opt, closure=lambda: 0.0)


def test_update_without_step(impl):
    _, _, s = setup(impl)
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
        s.update()


def test_step_before_scale(impl):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = impl("cpu")
    with pytest.raises(AssertionError, match="Attempted step but _scale is None"):
        s.step(opt)
    with pytest.raises(AssertionError, match="Attempted unscale_ but _scale is None"):
        s.unscale_(opt)
    with pytest.raises(AssertionError, match="Attempted update but _scale is None"):
        s.update()


def test_fp16_gradients(impl):
    _, opt, s = setup(impl, torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        s.unscale_(opt)


def test_empty_state_dict(impl):
    s = impl("cpu")
    with pytest.raises(
        RuntimeError,
        match="The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.",
    ):
        s.load_state_dict({})


def test_scale_non_tensor(impl):
    s = impl("cpu")
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        s.scale([torch.ones(1), 3.0])


@pytest.mark.parametrize(
    "kw", [{"growth_factor": 1.0}, {"growth_factor": 0.5}, {"backoff_factor": 1.0}, {"backoff_factor": 2.0}]
)
def test_bad_factors_raise_assertion_error_like_torch(impl, kw):
    with pytest.raises(AssertionError):
        impl("cpu", **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"growth_factor": 1.0},
        {"backoff_factor": 1.0},
        {"backoff_factor": 0.0},
        {"backoff_factor": -0.5},
        {"init_scale": 0.0},
        {"init_scale": -1.0},
        {"init_scale": float("inf")},
        {"growth_interval": 0},
        {"hysteresis": 0},
        {"min_scale": 0.0},
        {"min_scale": 2.0**20},
        {"hysteresis_mode": "megatron"},
    ],
)
def test_bad_settings_raise_value_error_naming_the_argument(kw):
    (name,) = kw
    with pytest.raises(ValueError, match=name):
        llmmem.GradScaler("cpu", **kw)


@pytest.mark.parametrize(
    "kw, limit",
    [
        ({"hysteresis": 2**31}, "2147483647"),
        ({"growth_interval": 2**63}, "9223372036854775807"),
        ({"init_scale": 1e39}, "float32"),
    ],
)
def test_settings_beyond_the_c_core_types_are_refused_at_construction(kw, limit):
    # each was accepted and then failed at the first scale() or update()
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name} must be .*{limit}"):
        llmmem.GradScaler("cpu", **kw)
    at_the_limit = {"hysteresis": 2**31 - 1, "growth_interval": 2**63 - 1, "init_scale": 3.0e38}[name]
    s = llmmem.GradScaler("cpu", **{**kw, name: at_the_limit})
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s.scale(model(torch.ones(1, 3)).sum()).backward()
    s.step(opt)
    s.update()


@pytest.mark.parametrize(
    "kw",
    [
        {"growth_interval": 2.5},
        {"hysteresis": "2"},
        {"init_scale": "big"},
        {"growth_factor": None},
        {"hysteresis_mode": 1},
    ],
)
def test_wrong_types_raise_type_error(kw):
    (name,) = kw
    with pytest.raises(TypeError, match=name):
        llmmem.GradScaler("cpu", **kw)


def test_setters_validate():
    s = llmmem.GradScaler("cpu")
    with pytest.raises(ValueError, match="growth_factor"):
        s.set_growth_factor(0.9)
    with pytest.raises(ValueError, match="backoff_factor"):
        s.set_backoff_factor(1.5)
    with pytest.raises(ValueError, match="growth_interval"):
        s.set_growth_interval(0)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (2.0, 0.5, 2000)


def test_scale_non_tensor_is_a_type_error():
    s = llmmem.GradScaler("cpu")
    with pytest.raises(TypeError, match="got float"):
        s.scale(3.0)
    with pytest.raises(TypeError, match="got str"):
        s.scale("loss")


def test_unsupported_gradient_dtype_names_the_parameter():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.complex64))
    p.grad = torch.ones(3, dtype=torch.complex64)
    opt = torch.optim.SGD([p], lr=0.1)
    s = llmmem.GradScaler("cpu")
    s.scale(torch.ones(1))
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\].*complex64"):
        s.unscale_(opt)


def test_cuda_scaler_without_cuda_disables_like_torch():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        s = llmmem.GradScaler("cuda")
    assert not s.is_enabled()


def test_pickle_mid_iteration_refused(impl):
    import pickle

    _, opt, s = setup(impl)
    s.unscale_(opt)
    with pytest.raises(AssertionError, match="may only be pickled at the beginning"):
        pickle.dumps(s)


class _LegacyAmpOptimizer(torch.optim.SGD):
    """An optimizer on the old contract: it takes the scaler as a `grad_scaler` keyword."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.seen_scaler = grad_scaler
        return "stepped"


def test_legacy_grad_scaler_kwarg_contract(impl):
    model = torch.nn.Linear(3, 2)
    opt = _LegacyAmpOptimizer(model.parameters(), lr=0.1)
    s = impl("cpu")
    s.scale(model(torch.ones(1, 3)).sum()).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        assert s.step(opt) == "stepped"
    assert opt.seen_scaler is s and not hasattr(opt, "found_inf")


# ---- load_state_dict: the whole dict checked before anything changes ---------------------------


def _trained_scaler(**kw):
    s = llmmem.GradScaler("cpu", init_scale=1024.0, growth_interval=3, **kw)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        s.scale(model(torch.ones(1, 3)).sum()).backward()
        s.step(opt)
        s.update()
    return s, model, opt


GOOD = {
    "scale": 512.0,
    "growth_factor": 4.0,
    "backoff_factor": 0.25,
    "growth_interval": 7,
    "_growth_tracker": 2,
    "hysteresis": 3,
    "_hysteresis_tracker": 1,
    "min_scale": 2.0,
    "hysteresis_mode": "on_growth",
}


@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            {"min_scale": 1024.0},
            ValueError,
            r"state_dict\['min_scale'\] must be in \(0, state_dict\['scale'\]=512.0\]",
        ),
        ({"min_scale": -1.0}, ValueError, r"state_dict\['min_scale'\]"),
        ({"min_scale": "2"}, TypeError, r"state_dict\['min_scale'\] must be a number, got str"),
        ({"growth_interval": "2000"}, TypeError, r"state_dict\['growth_interval'\] must be an int, got str"),
        ({"growth_interval": 0}, ValueError, r"state_dict\['growth_interval'\] must be >= 1"),
        ({"growth_interval": 2.0}, TypeError, r"state_dict\['growth_interval'\] must be an int"),
        ({"growth_factor": 1.0}, ValueError, r"state_dict\['growth_factor'\] must be > 1.0"),
        ({"growth_factor": 0.5}, ValueError, r"state_dict\['growth_factor'\]"),
        ({"growth_factor": None}, TypeError, r"state_dict\['growth_factor'\] must be a number"),
        ({"backoff_factor": 1.5}, ValueError, r"state_dict\['backoff_factor'\] must be in \(0, 1\)"),
        ({"scale": 0.0}, ValueError, r"state_dict\['scale'\] must be > 0"),
        ({"scale": 1e39}, ValueError, r"state_dict\['scale'\] must be <= .* \(a float32\)"),
        ({"scale": float("nan")}, ValueError, r"state_dict\['scale'\] must be finite"),
        ({"scale": torch.tensor(2.0)}, TypeError, r"state_dict\['scale'\] must be a number, got Tensor"),
        ({"_growth_tracker": -1}, ValueError, r"state_dict\['_growth_tracker'\] must be in \[0, 2147483647\]"),
        ({"_growth_tracker": True}, TypeError, r"state_dict\['_growth_tracker'\] must be an int, got bool"),
        ({"hysteresis": 0}, ValueError, r"state_dict\['hysteresis'\] must be >= 1"),
        ({"hysteresis": 2**31}, ValueError, r"state_dict\['hysteresis'\] must be <= 2147483647"),
        ({"hysteresis": "3"}, TypeError, r"state_dict\['hysteresis'\] must be an int"),
        ({"_hysteresis_tracker": 4}, ValueError, r"state_dict\['_hysteresis_tracker'\] must be in \[0, 3\]"),
        ({"hysteresis_mode": "megatron"}, ValueError, r"state_dict\['hysteresis_mode'\] must be one of"),
        ({"hysteresis_mode": 1}, TypeError, r"state_dict\['hysteresis_mode'\] must be a str"),
    ],
)
def test_load_state_dict_refuses_a_bad_value_naming_it_and_changes_nothing(change, error, match):
    s, _, _ = _trained_scaler(hysteresis=2, min_scale=4.0)
    before = s.state_dict()
    with pytest.raises(error, match=match):
        s.load_state_dict({**GOOD, **change})
    assert s.state_dict() == before
    llmmem.GradScaler("cpu").load_state_dict(GOOD)  # the same dict without the bad value loads


@pytest.mark.parametrize("missing", ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"])
def test_load_state_dict_names_a_missing_key(missing):
    s, _, _ = _trained_scaler()
    before = s.state_dict()
    sd = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(KeyError, match=f"state_dict has no '{missing}'") as info:
        s.load_state_dict(sd)
    assert isinstance(info.value, ValueError)  # like the other bad settings
    assert str(info.value).startswith("llmmem.GradScaler: state_dict has no")
    assert s.state_dict() == before


def test_load_state_dict_of_a_non_dict_is_a_type_error():
    with pytest.raises(TypeError, match="state_dict must be a dict, got list"):
        llmmem.GradScaler("cpu").load_state_dict([("scale", 1.0)])


def test_a_torch_state_below_this_scalers_min_scale_is_refused():
    s, _, _ = _trained_scaler(min_scale=64.0)
    before = s.state_dict()
    torch_sd = {k: GOOD[k] for k in ("growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")}
    with pytest.raises(ValueError, match=r"state_dict\['scale'\] must be >= this scaler's min_scale=64.0, got 8.0"):
        s.load_state_dict({**torch_sd, "scale": 8.0})
    assert s.state_dict() == before
    s.load_state_dict({**torch_sd, "scale": 128.0})  # keeps its own min_scale, with a full budget
    assert s.state_dict()["min_scale"] == 64.0 and s.get_scale() == 128.0


def test_load_state_dict_then_training_goes_on_with_the_loaded_settings():
    s, model, opt = _trained_scaler()
    s.load_state_dict(GOOD)
    assert s.state_dict() == GOOD
    for _ in range(5):  # growth_tracker 2 -> 7: grows once, by growth_factor 4
        opt.zero_grad()
        s.scale(model(torch.ones(1, 3)).sum()).backward()
        s.step(opt)
        s.update()
    assert s.get_scale() == 2048.0 and s.state_dict()["_growth_tracker"] == 0
