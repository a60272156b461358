"""The loss scaler's binding (csrc/python/amp.c, amp_params.c) against arguments whose conversion
or comparison runs Python code that empties the container being read: each entry point that reads
a list or dict, in a fresh interpreter (a crash must not take pytest down). Before the binding
took exact ints only in its lists and held each param group dict while reading it, the unscale
entry points and GradScaler.unscale_ on the CPU read freed memory here (segfaults)."""

from __future__ import annotations

import textwrap

import pytest
from support.procs import run_python

PRELUDE = """
from array import array

from llmmem._native import native

if not native:
    raise SystemExit("llmmem's C core is not loaded")


def addr(buf):
    return buf.buffer_info()[0]


found = array("f", [0.0])


reuse = []


class Emptying:
    '''An int-like whose __index__ (and __float__) empties `target` and drops what it held.'''

    def __init__(self, target, value):
        self.target, self.value = target, value

    def __index__(self):
        self.target.clear()
        # New objects over the freed item arrays, with no valid object address in them.
        reuse.extend(b"A" * 470 + bytes([i % 256]) for i in range(2000))
        return self.value

    __int__ = __index__

    def __float__(self):
        return float(self.__index__())


def outcome(call):
    try:
        print("returned", call())
    except Exception as e:
        print("raised", type(e).__name__, e)
"""


def run(*parts: str) -> str:
    """The last line the parts (each dedented) print, run after PRELUDE in a fresh interpreter."""
    proc = run_python("\n".join(textwrap.dedent(p) for p in (PRELUDE, *parts)), timeout=60)
    assert proc.returncode == 0, f"the interpreter died (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("entry", ["scaler_unscale_check", "scaler_unscale_check_cuda"])
@pytest.mark.parametrize("hostile_in, emptied", [("numels", "ptrs"), ("dtypes", "numels"), ("dtypes", "dtypes")])
def test_unscale_check_lists_take_exact_ints_only(entry, hostile_in, emptied):
    last = run(f"""
        grads = [array("f", [1.0] * 4) for _ in range(64)]
        lists = {{"ptrs": [addr(g) for g in grads], "numels": [4] * 64, "dtypes": [0] * 64}}
        lists["{hostile_in}"][10] = Emptying(lists["{emptied}"], lists["{hostile_in}"][10])
        tail = (0, 0) if "{entry}" == "scaler_unscale_check_cuda" else (1,)
        outcome(lambda: native.{entry}(lists["ptrs"], lists["numels"], lists["dtypes"], 0, False,
                                       addr(found), 0, 0, *tail))
        assert all(g.tolist() == [1.0] * 4 for g in grads)
    """)
    assert last == f"raised TypeError {hostile_in}[10] must be an int, got Emptying"


def test_update_found_inf_list_takes_exact_ints_only():
    last = run("""
        scale, growth, hyst, stats = array("f", [4.0]), array("i", [0]), array("i", [1]), array("q", [0] * 4)
        founds = [array("f", [0.0]) for _ in range(16)]
        ptrs = [addr(f) for f in founds]
        ptrs[3] = Emptying(ptrs, ptrs[3])
        args = (addr(scale), addr(growth), addr(hyst), addr(stats), ptrs)
        outcome(lambda: native.scaler_update(*args, 2.0, 0.5, 10, 1, 0.0))
        assert scale[0] == 4.0 and stats.tolist() == [0, 0, 0, 0]
    """)
    assert last.startswith("raised TypeError found_inf_ptrs[3] must be an int, got Emptying")


def test_update_scalars_that_empty_the_found_inf_list_before_it_is_read():
    # The scalars are converted first: the list is read afterwards, whatever they did to it.
    last = run("""
        scale, growth, hyst, stats = array("f", [4.0]), array("i", [0]), array("i", [1]), array("q", [0] * 4)
        one = array("f", [1.0])
        ptrs = [addr(one)]
        args = (addr(scale), addr(growth), addr(hyst), addr(stats), ptrs)
        outcome(lambda: native.scaler_update(*args, Emptying(ptrs, 2), 0.5, 10, 1, 0.0))
    """)
    assert last.startswith("raised InvalidArgumentError") and "no found_inf flags" in last


def test_check_config_and_inv_scale_read_no_container():
    last = run("""
        outcome(lambda: (native.scaler_check_config(Emptying([], 2), 0.5, Emptying([], 10), 1, 0.0),
                         native.scaler_inv_scale(Emptying([], 4))))
    """)
    assert last == "returned (None, 0.25)"


SCALER = """
import torch

import llmmem

params = [torch.nn.Parameter(torch.zeros(4)) for _ in range({n})]
for p in params:
    p.grad = torch.full((4,), 2.0)
opt = torch.optim.SGD(params, lr=0.1)
groups = opt.param_groups
scaler = llmmem.GradScaler("cpu", init_scale=2.0)
scaler.scale(torch.ones(()))
"""


@pytest.mark.parametrize("threads, at_call", [(1, 2), (2, 1), (2, 2), (2, 3)])
def test_unscale_with_a_param_group_key_whose_eq_drops_the_group(threads, at_call):
    # The C walk (csrc/python/amp_params.c) looks "params" up in each group dict, once to count
    # the parameters and once to walk them; the general path in Python after it. A key with the
    # hash of "params" is compared with it on each lookup, and its __eq__ drops the group dict.
    last = run(
        SCALER.format(n=300),
        f"""
        torch.set_num_threads({threads})

        class Key:
            armed, calls = False, 0

            def __hash__(self):
                return hash("params")

            def __eq__(self, other):
                if Key.armed:
                    Key.calls += 1
                    if Key.calls == {at_call}:
                        groups.clear()  # the group dict's last reference
                        [[object()] * 8 for _ in range(1000)]
                return False

        hostile = {{Key(): 0}}  # first in the dict, so every lookup of "params" meets it
        hostile.update(groups[0])
        groups[0] = hostile
        del hostile
        Key.armed = True
        outcome(lambda: scaler.unscale_(opt))
    """,
    )
    assert last.startswith("returned")


@pytest.mark.parametrize("threads", [1, 2])
def test_unscale_with_lists_emptied_by_attribute_reads_during_the_walk(threads):
    # Under a TorchFunctionMode the walk's attribute reads run Python code, here code that empties
    # the lists the walk is reading while it reads them.
    last = run(
        SCALER.format(n=300),
        f"""
        from torch.overrides import TorchFunctionMode

        torch.set_num_threads({threads})

        class Emptying(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if groups:
                    groups[0]["params"].clear()
                    groups.clear()
                    [[object()] * 8 for _ in range(1000)]
                return func(*args, **(kwargs or {{}}))

        with Emptying():
            outcome(lambda: scaler.unscale_(opt))
    """,
    )
    assert last.startswith("returned")
