"""In-place writes under the tracker's dispatch mode: version counters move as they do without it
(torch's foreach kernels bump none under a mode; LiveBytes bumps them), autograd still refuses a
backward through a tensor modified in place after it was saved (torch skips that check for tensors
saved through hooks; the tracker's hooks make it), and ``write_listeners`` hear what every
operator writes, from its schema (lists, ``out=``, fused kernels, batch norm's running statistics)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import llmmem
from llmmem.diagnostics.live import LiveBytes

CONTEXTS = {
    "no mode": contextlib.nullcontext,
    "LiveBytes": LiveBytes,
    "LiveBytes in LiveBytes": lambda: _nested(LiveBytes(), LiveBytes()),
    "MemoryTracker": llmmem.MemoryTracker,
}


@contextlib.contextmanager
def _nested(outer, inner):
    with outer, inner:
        yield


@pytest.mark.parametrize("make", CONTEXTS.values(), ids=CONTEXTS.keys())
def test_in_place_writes_bump_version_counters_as_without_a_mode(make):
    p, q = torch.randn(4), torch.randn(4)
    view = p[1:]
    with make(), torch.no_grad():
        torch._foreach_mul_([p, q], 2.0)
        torch._foreach_add_([view], [q[1:]])  # a view shares its base's counter
        p.mul_(2.0)
        torch.mul(q, 2.0, out=q)
    assert (p._version, q._version) == (3, 2)


def _saved_then_modified(how: str):
    x = torch.randn(8, requires_grad=True)
    y = x.sigmoid()  # sigmoid's backward reads y
    if how == "foreach":
        torch._foreach_mul_([y], 2.0)
    else:
        y.mul_(2.0)
    y.sum().backward()


@pytest.mark.parametrize("how", ["foreach", "in place"])
@pytest.mark.parametrize("make", CONTEXTS.values(), ids=CONTEXTS.keys())
def test_a_saved_tensor_modified_in_place_is_refused_as_without_a_mode(make, how):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with make():
            _saved_then_modified(how)


def test_a_tracked_training_step_computes_what_an_untracked_one_does():
    """Nothing that works without the tracker is refused under it: batch norm (its backward saves
    the running statistics its forward writes), an in-place activation, a foreach AdamW stepping
    the parameters the next forward saves again."""

    def train(tracked: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(inplace=True))
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        x = torch.randn(4, 8)
        with llmmem.MemoryTracker(model, opt) if tracked else contextlib.nullcontext():
            for _ in range(2):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


def test_write_listeners_hear_what_each_operator_writes():
    heard = []
    live = LiveBytes()
    live.write_listeners.append(lambda func, tensors: heard.append((func.__name__, [id(t) for t in tensors])))
    a, b, out = torch.randn(4), torch.randn(4), torch.empty(4)
    bn = torch.nn.BatchNorm1d(4)
    params, grads, m, v = [torch.randn(4)], [torch.randn(4)], [torch.zeros(4)], [torch.zeros(4)]
    with live, torch.no_grad():
        torch._foreach_mul_([a, b], 2.0)
        torch.mul(a, b, out=out)
        a.add_(1)
        torch.add(a, b)  # writes nothing: not heard
        bn(torch.randn(3, 4))
        bn.eval()(torch.randn(3, 4))  # reads the running statistics only
        torch._fused_adamw_(
            params, grads, m, v, [], [torch.tensor(1.0)], lr=0.1, beta1=0.9, beta2=0.99,
            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
    assert heard[:3] == [
        ("_foreach_mul_.Scalar", [id(a), id(b)]),
        ("mul.out", [id(out)]),
        ("add_.Tensor", [id(a)]),
    ]
    assert "add.Tensor" not in dict(heard)
    # training: the running statistics (and the batch count, by add_); eval: nothing written, not heard
    assert [ids for n, ids in heard if n == "native_batch_norm.default"] == [[id(bn.running_mean), id(bn.running_var)]]
    assert heard[-1] == ("_fused_adamw_.default", [id(t) for t in (*params, *grads, *m, *v)])


def test_inference_tensors_written_by_foreach_operators_are_left_alone():
    """They have no version counter to bump (reading it raises)."""
    with torch.inference_mode():
        a, b = torch.ones(4), torch.ones(4)
    normal = torch.ones(4)
    with LiveBytes(), torch.inference_mode():
        torch._foreach_mul_([a, b], 2.0)
        torch._foreach_mul_([a, normal], 2.0)  # a normal tensor written in inference mode is bumped
    assert torch.equal(a, torch.full((4,), 4.0)) and normal._version == 1
