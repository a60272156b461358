"""llmmem.GradScaler against torch.amp.GradScaler on the CPU: the same scripted training run
(>= 200 steps, inf and NaN injected into chosen gradients) must give the same scale trajectory,
growth tracker, skipped steps and bitwise-equal final parameters, for every optimizer torch
offers amp support for on the CPU (foreach and fused), two optimizers sharing one scaler,
unscale_ + clip_grad_norm_, and state_dict hand-overs in both directions."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import llmmem

IMPLS = {"torch": torch.amp.GradScaler, "llmmem": llmmem.GradScaler}
STEPS = 210


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny torch ops: its threads only spin


def make_model(dtype=torch.float32):
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    ).to(dtype)


def make_opt(kind, params):
    if kind == "sgd-foreach":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True)
    if kind == "sgd-fused":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)
    if kind == "adam-foreach":
        return torch.optim.Adam(params, lr=1e-3, foreach=True)
    if kind == "adam-fused":
        return torch.optim.Adam(params, lr=1e-3, fused=True)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
    raise ValueError(kind)


def poison(step, params):
    """Every 7th step one gradient gets inf, -inf or NaN at its first, middle or last element."""
    if step % 7 != 3:
        return
    p = params[(step // 7) % len(params)]
    flat = p.grad.view(-1)
    where = [0, flat.numel() // 2, flat.numel() - 1][(step // 7) % 3]
    flat[where] = [float("inf"), float("-inf"), float("nan")][(step // 11) % 3]


def run(
    impl,
    opt_kinds=("adam-foreach",),
    steps=STEPS,
    clip=False,
    dtype=torch.float32,
    scaler=None,
    start=0,
    model=None,
    opts=None,
    **scaler_kw,
):
    """Trains for `steps`; returns (trajectory, model, opts, scaler). Each trajectory entry is
    (scale, growth tracker, skipped per optimizer) after update()."""
    model = model or make_model(dtype)
    params = list(model.parameters())
    if opts is None:
        halves = [params] if len(opt_kinds) == 1 else [params[:2], params[2:]]
        opts = [make_opt(k, ps) for k, ps in zip(opt_kinds, halves)]
    scaler = scaler or IMPLS[impl]("cpu", init_scale=2.0**10, growth_interval=5, **scaler_kw)
    traj = []
    for step in range(start, start + steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 + step)).to(dtype)
        for o in opts:
            o.zero_grad()
        before = [[p.detach().clone() for g in o.param_groups for p in g["params"]] for o in opts]
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        poison(step, params)
        if clip:
            for o in opts:
                scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        for o in opts:
            scaler.step(o)
        scaler.update()
        skipped = tuple(
            all(torch.equal(b, p) for b, p in zip(bs, [p for g in o.param_groups for p in g["params"]]))
            for bs, o in zip(before, opts)
        )
        traj.append((scaler.get_scale(), scaler._get_growth_tracker(), skipped))
    return traj, model, opts, scaler


def assert_same_params(m1, m2):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), f"parameter {n} differs"


def assert_interesting(traj):
    """The schedule must actually exercise growth, backoff and skipping."""
    scales = [t[0] for t in traj]
    assert any(b > a for a, b in zip(scales, scales[1:])), "the scale never grew"
    assert any(b < a for a, b in zip(scales, scales[1:])), "the scale never backed off"
    assert sum(any(t[2]) for t in traj) >= 20


@pytest.mark.parametrize(
    "kind", ["sgd-foreach", "sgd-fused", "adam-foreach", "adam-fused", "adamw-foreach", "adamw-fused"]
)
def test_same_run_as_torch(kind):
    t_traj, t_model, _, _ = run("torch", (kind,))
    l_traj, l_model, _, _ = run("llmmem", (kind,))
    assert_interesting(t_traj)
    assert l_traj == t_traj
    assert_same_params(t_model, l_model)


def test_two_optimizers_share_one_scaler():
    t_traj, t_model, _, _ = run("torch", ("sgd-foreach", "adamw-fused"))
    l_traj, l_model, _, _ = run("llmmem", ("sgd-foreach", "adamw-fused"))
    assert_interesting(t_traj)
    assert l_traj == t_traj
    assert_same_params(t_model, l_model)


@pytest.mark.parametrize("kind", ["adam-foreach", "sgd-fused"])
def test_unscale_then_clip_grad_norm(kind):
    t_traj, t_model, _, _ = run("torch", (kind,), clip=True)
    l_traj, l_model, _, _ = run("llmmem", (kind,), clip=True)
    assert l_traj == t_traj
    assert_same_params(t_model, l_model)


def test_bf16_gradients_same_run_as_torch():
    t_traj, t_model, _, _ = run("torch", ("sgd-foreach",), dtype=torch.bfloat16)
    l_traj, l_model, _, _ = run("llmmem", ("sgd-foreach",), dtype=torch.bfloat16)
    assert l_traj == t_traj
    assert_same_params(t_model, l_model)


@pytest.mark.parametrize("first,second", [("torch", "llmmem"), ("llmmem", "torch")])
def test_state_dict_hand_over(first, second):
    """Train 60 steps with one implementation, hand its state_dict (and the model/optimizer) to
    the other, train on: the same as one implementation throughout."""
    ref_traj, ref_model, _, _ = run("torch", ("adam-foreach",), steps=120)
    traj1, model, opts, s1 = run(first, ("adam-foreach",), steps=60)
    sd = s1.state_dict()
    assert set(sd) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    s2 = IMPLS[second]("cpu")
    s2.load_state_dict(sd)
    assert s2.state_dict() == sd
    traj2, model, _, _ = run(second, ("adam-foreach",), steps=60, scaler=s2, start=60, model=model, opts=opts)
    assert traj1 + traj2 == ref_traj
    assert_same_params(ref_model, model)


@pytest.mark.parametrize("impl", IMPLS)
def test_pickle_round_trip(impl):
    _, _, _, s = run(impl, ("sgd-foreach",), steps=12)
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.state_dict() == s.state_dict()
    s3 = copy.deepcopy(s)
    assert s3.get_scale() == s.get_scale()


@pytest.mark.parametrize("impl", IMPLS)
def test_disabled_is_a_no_op(impl):
    model = make_model()
    opt = make_opt("sgd-foreach", model.parameters())
    s = IMPLS[impl]("cpu", enabled=False)
    loss = model(torch.randn(2, 8)).sum()
    assert s.scale(loss) is loss
    loss.backward()
    s.unscale_(opt)
    s.step(opt)
    s.update()
    assert s.get_scale() == 1.0 and s.state_dict() == {} and not s.is_enabled()
    s.load_state_dict({})


@pytest.mark.parametrize("impl", IMPLS)
def test_lazy_scale_and_getters_setters(impl):
    s = IMPLS[impl]("cpu", init_scale=128.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=9)
    assert s._scale is None and s.get_scale() == 128.0 and s._get_growth_tracker() == 0
    out = s.scale([torch.ones(2), (torch.ones(1, dtype=torch.float64),)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert out[0].tolist() == [128.0, 128.0] and out[1][0].dtype == torch.float64
    assert s._scale.dtype == torch.float32 and s._scale.dim() == 0
    assert s._growth_tracker.dtype == torch.int32
    lazy = s.scale(iter([torch.ones(1)]))
    assert list(lazy)[0].item() == 128.0
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 9)
    s.set_growth_factor(4.0)
    s.set_backoff_factor(0.125)
    s.set_growth_interval(11)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (4.0, 0.125, 11)


@pytest.mark.parametrize("impl", IMPLS)
def test_update_with_new_scale(impl):
    s = IMPLS[impl]("cpu")
    s.scale(torch.ones(1))
    s.update(3.0)
    assert s.get_scale() == 3.0
    s.update(torch.tensor(5.0))
    assert s.get_scale() == 5.0
    with pytest.raises(AssertionError, match="new_scale should be a float"):
        s.update(torch.tensor([1.0, 2.0]))
    with pytest.raises(AssertionError, match="new_scale should be a float"):
        s.update(torch.tensor(1.0, requires_grad=True))
