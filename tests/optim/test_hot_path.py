"""The hot path of llmmem.optim.AdamW's step: each parameter's record is kept between steps and,
for CPU groups, every gradient is read and checked in C (csrc/python/optim.c: optim_adamw_walk).
Whatever changes between steps must send the step back to its general path: a new parameter, a
parameter's storage swapped, a gradient that is strided or of another size, a replaced state,
a weight written outside the step (with a master); and the results always equal a fresh optimizer
stepped on the general path. An optimizer survives copy.deepcopy and pickling."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import llmmem.optim as lo


def _pair(n=3, size=5000, **kw):
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(size)) for _ in range(n)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    return a, b, lo.AdamW(a, lr=1e-2, seed=1, **kw), lo.AdamW(b, lr=1e-2, seed=1, **kw)


def _grads(a, b, seed):
    g = torch.Generator().manual_seed(seed)
    for p, q in zip(a, b):
        t = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad, q.grad = t.clone(), t.clone()


def _general_path(opt):
    opt._cached.clear()
    opt._group_caches.clear()


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def _step_both(a, b, oa, ob, seed):
    _grads(a, b, seed)
    oa.step()
    _general_path(ob)
    ob.step()
    assert _same(a, b)


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_the_walk_is_taken_and_equals_the_general_path(fmt):
    a, b, oa, ob = _pair(state_dtype=fmt, min_quantized_numel=64)
    for s in range(4):
        _step_both(a, b, oa, ob, s)
    assert oa._group_caches[id(oa.param_groups[0])] is not None  # the walk was armed


def test_changes_between_steps_go_back_to_the_general_path():
    a, b, oa, ob = _pair()
    _step_both(a, b, oa, ob, 0)
    _step_both(a, b, oa, ob, 1)
    # a parameter's storage swapped for another
    a[0].data = a[0].data.clone()
    b[0].data = b[0].data.clone()
    _step_both(a, b, oa, ob, 2)
    # a strided gradient
    _grads(a, b, 3)
    a[1].grad = torch.stack((a[1].grad, a[1].grad)).t()[:, 0]
    oa.step()
    _general_path(ob)
    ob.step()
    assert _same(a, b)
    # a parameter added to the group, and one without a gradient
    pa, pb = torch.nn.Parameter(torch.ones(300)), torch.nn.Parameter(torch.ones(300))
    oa.param_groups[0]["params"].append(pa)
    ob.param_groups[0]["params"].append(pb)
    pa.grad, pb.grad = torch.ones(300), torch.ones(300)
    _step_both(a, b, oa, ob, 4)
    assert torch.equal(pa, pb) and float(oa.state[pa]["step"]) == 1.0
    a[2].grad = b[2].grad = None
    _step_both(a, b, oa, ob, 5)
    # a state replaced by hand: the new one is used
    oa.state[a[1]] = copy.deepcopy(ob.state[b[1]])
    _step_both(a, b, oa, ob, 6)
    # a state tensor replaced by hand
    oa.state[a[0]]["exp_avg"] = ob.state[b[0]]["exp_avg"].clone()
    _step_both(a, b, oa, ob, 7)


def test_a_weight_written_outside_the_step_reaches_its_master():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5000).bfloat16())
    opt = lo.AdamW([w], lr=1e-2, master_weights=True)
    for _ in range(3):
        w.grad = torch.randn(5000).bfloat16()
        opt.step()
    with torch.no_grad():
        w[:10] = 1.0  # an in-place write moves the version counter
    w.grad = torch.zeros(5000).bfloat16()
    opt.param_groups[0]["lr"] = 0.0
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step()
    assert torch.equal(opt.state[w]["master"][:10], torch.ones(10))


def test_deepcopy_and_pickle_make_an_independent_optimizer():
    a, b, oa, ob = _pair(state_dtype="int8", min_quantized_numel=64)
    _step_both(a, b, oa, ob, 0)
    _step_both(a, b, oa, ob, 1)
    for clone in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        twin = clone(oa)
        params = [p for g in twin.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in a]
        twin.step()  # steps the copies, never the originals' memory
        assert all(torch.equal(x, y) for x, y in zip(a, before))
        assert all(not torch.equal(p, x) for p, x in zip(params, before))


@pytest.mark.parametrize(
    "fmt,key",
    [
        ("fp32", "exp_avg_sq"),
        ("fp32", "step"),
        ("int8", "exp_avg_sq"),
        ("int8", "exp_avg_scale"),
        ("int8", "exp_avg_sq_scale"),
    ],
)
@pytest.mark.parametrize("how", ["replaced", "data_swapped"])
def test_every_state_tensor_replaced_by_hand_is_the_one_stepped(fmt, key, how):
    # the cached records hold the state tensors' addresses: a stale one would write the tensor the
    # state no longer holds (freed memory when nothing else keeps it)
    a, b, oa, ob = _pair(state_dtype=fmt, min_quantized_numel=64)
    _step_both(a, b, oa, ob, 0)
    _step_both(a, b, oa, ob, 1)
    fresh = ob.state[b[0]][key].clone()
    if how == "replaced":
        oa.state[a[0]][key] = fresh
    else:
        oa.state[a[0]][key].data = fresh  # the same tensor object on other storage
    _step_both(a, b, oa, ob, 2)
    assert torch.equal(oa.state[a[0]][key], ob.state[b[0]][key])
    assert float(oa.state[a[0]]["step"]) == 3.0


def test_a_master_replaced_by_hand_is_the_one_stepped():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5000).bfloat16()) for _ in range(2)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa, ob = (lo.AdamW(ps, lr=1e-2, seed=1, master_weights=True) for ps in (a, b))
    _step_both(a, b, oa, ob, 0)
    _step_both(a, b, oa, ob, 1)
    oa.state[a[0]]["master"] = ob.state[b[0]]["master"].clone()
    _step_both(a, b, oa, ob, 2)
    assert torch.equal(oa.state[a[0]]["master"], ob.state[b[0]]["master"])


class _CountingList(list):
    """A group's params list that counts how often it is walked."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_the_first_step_walks_the_groups_a_bounded_number_of_times():
    # each new state's seed needs its parameter's index: found by walking every group once per
    # parameter, the first step was quadratic (16000 tensors: 7.4 s against torch fused's 0.6 s)
    ps = [torch.nn.Parameter(torch.randn(8)) for _ in range(400)]
    opt = lo.AdamW(ps, lr=1e-2, seed=1)
    opt.param_groups[0]["params"] = _CountingList(opt.param_groups[0]["params"])
    for p in ps:
        p.grad = torch.ones_like(p)
    _CountingList.walks = 0
    opt.step()
    assert _CountingList.walks <= 5
    # and the seeds are those of each parameter's index, as before
    ref = lo.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2, seed=1)
    for q in ref.param_groups[0]["params"]:
        q.grad = torch.ones_like(q)
    ref.step()
    assert [opt.state[p]["seed"] for p in ps] == [ref.state[q]["seed"] for q in ref.param_groups[0]["params"]]
