"""The CPU fast path of GradScaler.unscale_ (csrc/python/amp_params.c: one C call walks the
param_groups and runs the kernel) against torch.amp.GradScaler: gradients reallocated or swapped
between steps (nothing may be cached), the cases it hands back to the general path (strided
views, misaligned data, tensor subclasses, other devices, sparse gradients) having written
nothing, mixed dtypes, empty gradients, parameters without gradients, and its error cases."""

from __future__ import annotations

import pytest
import torch
from support.amp import ODD_LAYOUTS, assert_same, interrupt_once_on, odd_layout_param, p_with

import llmmem
from llmmem.amp import cpu_unscale as CU
from llmmem.amp import kernels as K

SCALE = 1024.0


def found_of(scaler, opt):
    per_device = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    return {str(d): float(t.item()) for d, t in per_device.items()}


def unscale_both(make_grads):
    """Runs torch's and llmmem's unscale_ on equal copies of the gradients ``make_grads()`` returns
    (a list, None meaning no gradient); checks gradients, found_inf and the overflow record."""
    results = []
    for cls in (torch.amp.GradScaler, llmmem.GradScaler):
        torch.manual_seed(0)
        grads = make_grads()
        params = [p_with(g) for g in grads]
        opt = torch.optim.SGD(params, lr=0.1)
        s = cls("cpu", init_scale=SCALE)
        s.scale(torch.ones(()))
        s.unscale_(opt)
        results.append((s, opt, params))
    (ts, topt, tparams), (ls, lopt, lparams) = results
    for tp, lp in zip(tparams, lparams):
        assert (tp.grad is None) == (lp.grad is None)
        if tp.grad is not None:
            assert_same(lp.grad, tp.grad)
    assert found_of(ls, lopt) == found_of(ts, topt)
    return ls, lopt, lparams


def fast_taken(params, allow_fp16=False):
    """Whether the fast path takes ``params`` (it then unscales them by 1: a check only)."""
    opt = torch.optim.SGD(params, lr=0.1)
    return CU.walk(opt.param_groups, allow_fp16, torch.zeros(()), torch.ones(()), True) is not None


def test_plain_gradients_take_the_fast_path_and_match_torch():
    def grads():
        gs = [torch.randn(n) * SCALE for n in (1, 7, 4097, 100, 3)]
        gs[2][4096] = float("inf")
        return gs

    assert fast_taken([p_with(g) for g in grads()])
    ls, lopt, _ = unscale_both(grads)
    assert ls.overflowed_params(optimizer=lopt) == [(0, 2)]


@pytest.mark.parametrize("special", [float("nan"), float("-inf")])
def test_mixed_dtypes(special):
    def grads():
        gs = [
            (torch.randn(n) * SCALE).to(dt)
            for n, dt in [
                (33, torch.float32),
                (65, torch.bfloat16),
                (17, torch.float64),
                (0, torch.bfloat16),
                (5, torch.float32),
            ]
        ]
        gs[1][64] = special
        return gs

    assert fast_taken([p_with(g) for g in grads()])
    ls, lopt, _ = unscale_both(grads)
    assert ls.overflowed_params(optimizer=lopt) == [(0, 1)]


def test_fp16_gradients_raise_torchs_error_and_are_left_alone():
    g16 = torch.randn(8).half()
    g32 = torch.randn(8)
    before = (g16.clone(), g32.clone())
    params = [p_with(g32), p_with(g16)]
    assert not fast_taken(params)  # the general path raises; the fast path hands it over
    s = llmmem.GradScaler("cpu", init_scale=SCALE)
    s.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        s.unscale_(torch.optim.SGD(params, lr=0.1))
    assert torch.equal(g16, before[0]) and torch.equal(g32, before[1])  # nothing written before the error
    assert fast_taken(params, allow_fp16=True)


def test_empty_gradients_and_parameters_without_gradients():
    def grads():
        gs = [None, torch.empty(0), torch.randn(4) * SCALE, None, torch.empty(0, 3), torch.randn(9) * SCALE]
        gs[5][8] = float("nan")
        return gs

    ls, lopt, lparams = unscale_both(grads)
    assert ls.overflowed_params(optimizer=lopt) == [(0, 5)]
    only_empty = [p_with(torch.empty(0)), p_with(None)]
    assert fast_taken(only_empty)


def test_no_gradient_at_all_records_nothing_like_torch():
    for cls in (torch.amp.GradScaler, llmmem.GradScaler):
        params = [torch.nn.Parameter(torch.zeros(2))]
        opt = torch.optim.SGD(params, lr=0.1)
        s = cls("cpu")
        s.scale(torch.ones(()))
        s.unscale_(opt)
        assert found_of(s, opt) == {}
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer."):
            s.step(opt)


def test_gradients_reallocated_between_steps_match_torch():
    """zero_grad(set_to_none=True) gives new gradient tensors every step (new addresses, sizes
    freed and reused by the allocator); p.grad may also be reassigned to another dtype, or a grad's
    storage swapped in place (set_, .data =, resize_). Every step must see the current ones."""
    torch.manual_seed(1)
    model_t = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model_l = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model_l.load_state_dict(model_t.state_dict())
    runs = []
    for cls, model in ((torch.amp.GradScaler, model_t), (llmmem.GradScaler, model_l)):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        s = cls("cpu", init_scale=SCALE, growth_interval=3)
        gen = torch.Generator().manual_seed(2)
        record = []
        for step in range(12):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(8, 16, generator=gen)
            s.scale(model(x).pow(2).mean()).backward()
            p0, p1, p2 = list(model.parameters())[:3]
            if step % 4 == 1:
                p1.grad = p1.grad.clone()  # another allocation
            if step % 4 == 2:
                p0.grad.data = p0.grad.data.double()  # same tensor object, new storage and dtype
            if step % 4 == 3:
                g = p2.grad
                g.set_(g.clone().untyped_storage(), 0, g.shape, g.stride())  # same object, set_ to a copy
            if step in (5, 9):
                p1.grad.view(-1)[3] = float("inf")
            s.unscale_(opt)
            record.append([p.grad.clone() for p in model.parameters()])
            s.step(opt)
            s.update()
            record.append(s.get_scale())
        runs.append(record)
    assert runs[0][1::2] == runs[1][1::2]  # the same scale trajectory, including the two backoffs
    for gt, gl in zip(runs[0][0::2], runs[1][0::2]):
        for a, b in zip(gt, gl):
            assert_same(b, a)
    for a, b in zip(model_t.parameters(), model_l.parameters()):
        assert_same(b.detach(), a.detach())


def test_resized_gradient_object_is_read_anew():
    g = torch.randn(4) * SCALE
    p = p_with(g)
    opt = torch.optim.SGD([p], lr=0.1)
    s = llmmem.GradScaler("cpu", init_scale=SCALE)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    s.step(opt)
    s.update()
    g.resize_(5000)  # same object: new storage, more elements
    g.fill_(SCALE)
    g[4999] = float("inf")
    s.scale(torch.ones(()))
    s.unscale_(opt)
    assert torch.equal(g[:4999], torch.ones(4999))
    assert found_of(s, opt) == {"cpu": 1.0}


def test_non_contiguous_gradients_go_the_general_way_and_match_torch():
    def grads():
        base = torch.randn(64, 32) * SCALE
        base[5, 3] = float("inf")
        return [
            torch.randn(10) * SCALE,
            base.t(),
            (torch.randn(40) * SCALE)[::3],
            (torch.randn(4, 9) * SCALE)[1:3, 4:9],
            torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1),
        ]

    gs = grads()
    before = [g.clone() for g in gs]
    assert not fast_taken([p_with(g) for g in gs])
    for a, b in zip(gs, before):
        assert torch.equal(a, b)  # handed over untouched
    unscale_both(grads)


def test_misaligned_gradients_go_the_general_way_and_match_torch():
    def grads():
        buf = bytearray(4 * 100 + 2)
        g = torch.frombuffer(buf, dtype=torch.float32, offset=2, count=100)  # 2-byte aligned fp32
        g.copy_(torch.randn(100) * SCALE)
        g[50] = float("nan")
        return [torch.randn(8) * SCALE, g]

    gs = grads()
    assert gs[1].data_ptr() % 4 != 0
    assert not fast_taken([p_with(g) for g in gs])
    unscale_both(grads)


class _Sub(torch.Tensor):
    pass


def test_subclasses_and_other_devices_are_handed_over():
    plain = [p_with(torch.randn(4))]
    assert fast_taken(plain)
    assert not fast_taken(plain + [p_with(torch.randn(4).as_subclass(_Sub))])  # gradient subclass
    sub_param = torch.randn(4).as_subclass(_Sub)
    sub_param.grad = torch.randn(4)
    assert not fast_taken(plain + [sub_param])  # parameter subclass
    assert not fast_taken(plain + [p_with(torch.randn(4, device="meta"))])
    g = torch.randn(4)
    before = g.clone()
    assert not fast_taken([p_with(g * SCALE), p_with(torch.randn(3).to_sparse())])
    plain_tensor_param = torch.zeros(3, requires_grad=True)
    plain_tensor_param.grad = torch.randn(3)
    assert fast_taken([plain_tensor_param])
    assert torch.equal(g, before)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", ODD_LAYOUTS)
def test_gradients_of_every_other_layout_are_handed_over(layout):
    g = torch.randn(5) * SCALE
    before = g.clone()
    odd = odd_layout_param(layout)
    odd_before = odd.grad.to_dense()
    assert not fast_taken([p_with(g), odd])
    assert torch.equal(g, before)
    assert torch.equal(odd.grad.to_dense(), odd_before)


def test_cpu_and_meta_gradients_agree_with_torch_on_the_cpu_ones():
    def grads():
        return [torch.randn(6) * SCALE, torch.randn(3, device="meta"), torch.randn(6) * SCALE]

    for cls in (torch.amp.GradScaler, llmmem.GradScaler):
        torch.manual_seed(0)
        gs = grads()
        params = [p_with(g) for g in gs]
        s = cls("cpu", init_scale=SCALE)
        s.scale(torch.ones(()))
        s.unscale_(torch.optim.SGD(params, lr=0.1))
        if cls is torch.amp.GradScaler:
            want = [gs[0].clone(), gs[2].clone()]
        else:
            assert_same(gs[0], want[0])
            assert_same(gs[2], want[1])


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")  # torch's own, from inside
def test_sparse_gradients_match_torch():
    def grads():
        i = torch.tensor([[0, 2, 2]])
        return [torch.randn(5) * SCALE, torch.sparse_coo_tensor(i, torch.tensor([1.0, SCALE, float("inf")]), (4,))]

    for cls in (torch.amp.GradScaler, llmmem.GradScaler):
        params = [p_with(g) for g in grads()]
        opt = torch.optim.SGD(params, lr=0.1)
        s = cls("cpu", init_scale=SCALE)
        s.scale(torch.ones(()))
        s.unscale_(opt)
        assert found_of(s, opt) == {"cpu": 1.0}


def test_unsupported_dtype_and_non_tensor_parameter_errors_unchanged():
    params = [p_with(torch.randn(3)), p_with(torch.randn(3))]
    params[1].grad.data = torch.zeros(3, dtype=torch.int32)  # .data may change the dtype; .grad = may not
    s = llmmem.GradScaler("cpu")
    s.scale(torch.ones(()))
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\] has dtype torch.int32"):
        s.unscale_(torch.optim.SGD(params, lr=0.1))
    opt = torch.optim.SGD([p_with(torch.randn(3))], lr=0.1)
    opt.param_groups[0]["params"].append("not a tensor")
    s2 = llmmem.GradScaler("cpu")
    s2.scale(torch.ones(()))
    with pytest.raises(AssertionError, match="expected param to be torch.Tensor, got str"):
        s2.unscale_(opt)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_small_gradients_match_torch(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:

        def grads():
            gen = torch.Generator().manual_seed(3)
            gs = [torch.randn(int(n), generator=gen) * SCALE for n in torch.randint(0, 3000, (600,), generator=gen)]
            gs[123].view(-1)[-1:] = float("inf") if gs[123].numel() else 0.0
            gs[599].view(-1)[:1] = float("nan") if gs[599].numel() else 0.0
            return gs

        ls, lopt, _ = unscale_both(grads)
        assert ls.overflowed_params(optimizer=lopt) == [(0, 123), (0, 599)]
    finally:
        torch.set_num_threads(before)


def test_odd_scalars_are_handed_over_not_raised():
    params = [p_with(torch.randn(3))]
    opt = torch.optim.SGD(params, lr=0.1)
    f32 = torch.zeros(())
    two = torch.full((), 2.0)  # a real unscale, so a write would show
    for found, scale in [
        (torch.zeros((), dtype=torch.float64), two),
        (f32, torch.ones((), dtype=torch.float64)),
        (f32, torch.ones(2)),
        (torch.zeros(()).as_subclass(_Sub), two),
        (f32, two.as_subclass(_Sub)),
    ]:
        before = params[0].grad.clone()
        assert CU.walk(opt.param_groups, False, found, scale) is None
        assert torch.equal(params[0].grad, before)


def test_the_walk_returns_its_flags_and_counts_its_progress():
    from array import array

    grads = [torch.tensor([1.0, 2.0]), torch.tensor([float("inf")]), torch.tensor([4.0])]
    params = [p_with(g.clone()) for g in grads]
    opt = torch.optim.SGD(params, lr=0.1)
    found, progress = torch.zeros(()), array("q", [-1])
    w = CU.walk(opt.param_groups, False, found, torch.full((), 2.0), progress=progress)
    assert (w.n_grads, list(w.slots), w.resume, w.flags.tolist()) == (3, [0, 1, 2], None, [0, 1, 0])
    assert progress[0] == 3 and float(found) == 1.0
    assert torch.equal(params[0].grad, torch.tensor([0.5, 1.0]))


def test_a_progress_cell_of_another_kind_is_refused_with_nothing_done():
    from array import array

    params = [p_with(torch.tensor([1.0, 2.0]))]
    opt = torch.optim.SGD(params, lr=0.1)
    for cell in [array("i", [0]), array("d", [0.0]), array("q", [0, 0]), array("q"), bytearray(8), b"\0" * 8, 0]:
        with pytest.raises(TypeError):
            CU.walk(opt.param_groups, False, torch.zeros(()), torch.full((), 2.0), progress=cell)
        assert torch.equal(params[0].grad, torch.tensor([1.0, 2.0]))


def test_the_found_inf_of_the_scale_device_is_the_tensor_unscale_made():
    # no copy on the master's own device (one tensor op fewer per unscale_); other devices get copies
    from llmmem.amp.grad_scaler import _MultiDeviceReplicator

    master = torch.zeros(())
    rep = _MultiDeviceReplicator(master, share_own_device=True)
    assert rep.get(torch.device("cpu")) is master
    meta = rep.get(torch.device("meta"))
    assert meta is not master and meta.device.type == "meta" and rep.get(torch.device("meta")) is meta
    # the scale's replicators copy, as torch's: a scaled output must not record the live scale
    copied = _MultiDeviceReplicator(master).get(torch.device("cpu"))
    assert copied is not master and torch.equal(copied, master)
    s = llmmem.GradScaler("cpu", init_scale=4.0)
    outs = s.scale([torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)])
    s._scale.fill_(8.0)  # an in-place change of the scale before backward, as update(new_scale=...) makes
    outs[0].sum().backward()  # torch's list path keeps a copy: no "modified by an inplace operation"


def test_float64_scale_goes_the_general_way_and_matches_torch():
    results = []
    for cls in (torch.amp.GradScaler, llmmem.GradScaler):
        torch.manual_seed(0)
        g = torch.randn(5) * SCALE
        params = [p_with(g)]
        s = cls("cpu", init_scale=SCALE)
        s.scale(torch.ones(()))
        s._scale = torch.full((), 3.0, dtype=torch.float64)
        s.unscale_(torch.optim.SGD(params, lr=0.1))
        results.append(g)
    assert_same(results[1], results[0])


def test_unscale_uses_the_fast_path_for_plain_gradients(monkeypatch):
    def general_path(*args, **kwargs):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(K, "unscale_check_", general_path)
    g = torch.randn(6) * SCALE
    want = g / SCALE
    opt = torch.optim.SGD([p_with(g), p_with(None)], lr=0.1)
    s = llmmem.GradScaler("cpu", init_scale=SCALE)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    assert_same(g, want)
    opt.param_groups[0]["params"][0].grad = (torch.randn(12) * SCALE)[::2]  # a strided view: general path
    s.update()
    s.scale(torch.ones(()))
    with pytest.raises(AssertionError, match="the general path ran"):
        s.unscale_(opt)


def test_no_reference_leaks_on_success_or_hand_over():
    import sys

    grads = [torch.randn(5) * SCALE, torch.randn(3) * SCALE]
    params = [p_with(grads[0]), p_with(None), p_with(grads[1])]
    opt = torch.optim.SGD(params, lr=0.1)
    found, one = torch.zeros(()), torch.ones(())
    before = [sys.getrefcount(x) for x in grads + params]
    for _ in range(50):
        w = CU.walk(opt.param_groups, False, found, one, True)
        assert (w.n_grads, list(w.slots), w.resume, w.flags.tolist()) == (2, [0, 2], None, [0, 0])
    params.append(p_with(torch.randn(4, 4).t()))  # a strided view: the walk stops there and hands over
    opt2 = torch.optim.SGD(params, lr=0.1)
    for _ in range(50):
        assert CU.walk(opt2.param_groups, False, found, one, True) is None
    del opt2
    params.pop()
    assert [sys.getrefcount(x) for x in grads + params] == before


def test_an_interrupt_raised_during_the_walk_propagates():
    # Under a TorchFunctionMode the walk's attribute reads run Python code, where a signal handler
    # can raise KeyboardInterrupt; the walk hands other errors over to the general path (which
    # reports them itself), but an interrupt must not be swallowed.
    grad = torch.randn(4)

    mode = interrupt_once_on(grad)

    opt = torch.optim.SGD([p_with(grad)], lr=0.1)
    found, one = torch.zeros(()), torch.ones(())
    with mode, pytest.raises(KeyboardInterrupt):
        CU.walk(opt.param_groups, False, found, one, True)
    assert mode.fired


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("how", ["shared-strided-view", "same-param-misaligned", "view-and-its-base"])
def test_memory_listed_twice_through_copies_is_unscaled_twice_as_torch(threads, how):
    # The general path copies non-dense or misaligned gradients; a copy must not drop the other
    # listing's multiplication (its copy back would come last): such lists go one tensor at a time.
    import warnings

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for cls in (torch.amp.GradScaler, llmmem.GradScaler):
            if how == "shared-strided-view":
                buf = torch.full((64, 8), SCALE * SCALE)
                a, b = p_with(buf[:, ::2]), p_with(None)
                b.data = torch.zeros(64, 4)
                b.grad = a.grad
                plist = [a, b]
            elif how == "same-param-misaligned":
                raw = bytearray(4 * 33 + 1)
                g = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=33)
                g.fill_(SCALE * SCALE)
                a = p_with(g)
                plist = [a, a]
            else:
                base = torch.full((16, 6), SCALE * SCALE)
                a, b = p_with(base), p_with(None)
                b.data = torch.zeros(16, 3)
                b.grad = base[:, ::2]  # strided: copied; its memory is also a's gradient
                plist = [a, b]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns about a duplicated parameter
                opt = torch.optim.SGD(plist, lr=0.1)
            s = cls("cpu", init_scale=SCALE)
            s.scale(torch.ones(()))
            s.unscale_(opt)
            results.append([p.grad.clone() for p in plist])
        for t, ll in zip(*results):
            assert_same(ll, t)
    finally:
        torch.set_num_threads(before)


def test_on_a_gpu_a_repeated_address_sends_the_list_one_tensor_at_a_time():
    # On CUDA one launch would run both listings in concurrent blocks; the decision is made on the
    # host from addresses, so it is checked here with CPU tensors standing in.
    a, b = torch.randn(8), torch.randn(8)
    cuda = torch.device("cuda")
    ptrs = [a.data_ptr(), b.data_ptr(), a.data_ptr()]
    assert K._must_go_in_order([a, b, a], ptrs, [8, 8, 8], [], cuda)
    assert not K._must_go_in_order([a, b], ptrs[:2], [8, 8], [], cuda)
    assert not K._must_go_in_order([a, b, a], ptrs, [8, 8, 8], [], torch.device("cpu"))  # the C kernel orders it
    empty = torch.empty(0)
    assert not K._must_go_in_order([empty, empty], [0, 0], [0, 0], [], cuda)  # no memory, no repeat
