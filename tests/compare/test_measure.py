"""The largest-fit search and the timeline decimation (pure logic), and one measured step."""

from __future__ import annotations

import pytest
import torch

from llmmem.compare.measure import MAX_GROWTH, decimate, search_largest


@pytest.mark.parametrize("true_largest", [4, 5, 9, 31, 200])
def test_linear_search_brackets_the_true_largest(true_largest):
    # a step's peak grows linearly with the batch: state + per-sample activations
    state, per = 1000, 37
    cap = state + per * true_largest + per // 2
    calls = []

    def peak_at(n):
        calls.append(n)
        return state + per * n

    r = search_largest(peak_at, start=4, start_peak=state + 4 * per, cap=cap, trials=4, kind="batch")
    assert r["largest"] == true_largest and r["exact"]
    # 200 from 8: the line's guess is held to MAX_GROWTH x 8 = 128 first, a trial more
    assert len(calls) <= (3 if true_largest <= 8 * MAX_GROWTH else 4)
    assert all(b <= MAX_GROWTH * a for a, b in zip([4] + calls, calls))


@pytest.mark.parametrize("true_largest", [2, 5, 11, 31])
def test_linear_search_from_the_fixed_bytes_needs_two_trials(true_largest):
    # with the peak at batch 0 known (parameters, gradients, optimizer state), the first guess is
    # the line through it and the measured batch: the answer, then its neighbour to prove it
    state, per = 1000, 37
    cap = state + per * true_largest + per // 2
    r = search_largest(
        lambda n: state + per * n,
        start=2,
        start_peak=state + 2 * per,
        cap=cap,
        trials=4,
        kind="batch",
        intercept=state,
    )
    assert r["largest"] == true_largest and r["exact"]
    assert [t[0] for t in r["trials"]] == ([true_largest, true_largest + 1] if true_largest > 2 else [3])


def test_a_nearly_flat_peak_grows_the_size_at_most_max_growth_times_a_trial():
    # the peak grows by 1 byte a sample: the line puts the cap a million samples out
    r = search_largest(lambda n: 1000 + n, start=2, start_peak=1002, cap=10**6, trials=3, kind="batch", intercept=1000)
    assert [t[0] for t in r["trials"]] == [2 * MAX_GROWTH, 2 * MAX_GROWTH**2, 2 * MAX_GROWTH**3]
    assert r["largest"] == 2 * MAX_GROWTH**3 and not r["exact"]


def test_search_counts_infeasible_as_not_fitting_and_stops_at_the_budget():
    r = search_largest(lambda n: None if n > 6 else 10 * n, start=2, start_peak=20, cap=10**6, trials=3, kind="batch")
    assert r["largest"] is not None and r["largest"] <= 6
    assert len(r["trials"]) <= 3


def test_first_guess_then_neighbour_then_bisection():
    def peak_at(n):  # not linear: a plan fills its budget
        return 100 if n <= 13 else 200

    r = search_largest(peak_at, start=4, start_peak=100, cap=150, trials=5, kind="batch", first=14, linear=False)
    assert [t[0] for t in r["trials"]][:2] == [14, 13]
    assert r["largest"] == 13 and r["exact"]


def test_start_that_does_not_fit_searches_down():
    r = search_largest(lambda n: 10 * n, start=8, start_peak=80, cap=45, trials=4, kind="batch")
    assert r["largest"] == 4 and r["exact"]


def test_decimate_keeps_the_peak():
    points = [(i * 0.001, (i * 7919) % 1000) for i in range(10000)]
    points[5123] = (points[5123][0], 5000)
    out = decimate(points, limit=100)
    assert len(out) <= 100
    assert max(b for _, b in out) == 5000
    assert [t for t, _ in out] == sorted(t for t, _ in out)


def test_measured_step_counts_state_and_activations():
    from llmmem.compare.measure import measured_step
    from llmmem.compare.strategies import Strategy
    from llmmem.compare.worker import Trainer, make_optimizer
    from llmmem.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.0))
    trainer = Trainer(model, make_optimizer(model.parameters(), 1e-3), Strategy("baseline", "b"), torch.device("cpu"))
    trainer.prime()
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    m = measured_step(trainer, x, y, torch.device("cpu"), timeline=True)
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    state = params * 4 + buffers + 2 * x.numel() * 8  # parameters, gradients, Adam's two moments; x and y
    # AdamW keeps a 0-dim float32 "step" per parameter too
    assert m["start_bytes"] == state + 4 * len(list(model.parameters()))
    assert m["peak_bytes"] >= m["start_bytes"] + m["activation_bytes"]
    assert m["activation_bytes"] > 2 * 32 * 32 * 4 * 2  # at least each block's input
    assert set(m["phases"]) == {"forward", "backward", "optimizer"}
    assert max(b for _, b in m["timeline"]) == m["peak_bytes"]


def test_the_reference_trainer_is_freed_before_the_measured_step():
    """The fp32 reference steps beside the timed ones and must hold no memory in the measured step
    (on CUDA its model, gradients and Adam state would count in the row's peak)."""
    import weakref

    from llmmem.compare.measure import train_and_measure
    from llmmem.compare.strategies import Strategy
    from llmmem.compare.worker import Trainer, make_optimizer
    from llmmem.models.gpt import GPT, GPTConfig

    def trainer_of_a_small_gpt():
        model = GPT(GPTConfig(layers=2, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.0))
        trainer = Trainer(
            model, make_optimizer(model.parameters(), 1e-3), Strategy("baseline", "b"), torch.device("cpu")
        )
        trainer.prime()
        return trainer

    torch.manual_seed(0)
    trainer = trainer_of_a_small_gpt()
    reference_alive, alive_at_step, own_step = [], [], trainer.step

    def make_reference():  # like the worker, the caller keeps no reference to it
        reference = trainer_of_a_small_gpt()
        reference_alive.append(weakref.ref(reference))
        return reference

    def recording_step(*args, **kwargs):
        alive_at_step.append(reference_alive[0]() is not None)
        return own_step(*args, **kwargs)

    def batches():
        return torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))

    trainer.step = recording_step
    out = train_and_measure(trainer, batches, 4, torch.device("cpu"), reference=make_reference())
    assert alive_at_step == [True, True, True, False]
    assert len(out["losses"]) == 4 and len(out["reference_step_times"]) == 2


def test_pairs_alternate_their_order_and_report_their_spread(monkeypatch):
    """The strategy and the fp32 reference take turns going first on a batch (the second finds it in
    cache), and the spread of the paired ratios is recorded beside their median."""
    from llmmem.compare.measure import median_spread, train_and_measure

    order = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def step(self, x, y):
            order.append(self.name)
            return 1.0

    import llmmem.compare.measure as m

    monkeypatch.setattr(m, "measured_step", lambda trainer, x, y, device, timeline: {"loss": 1.0})
    out = train_and_measure(Fake("s"), lambda: (None, None), 6, torch.device("cpu"), reference=Fake("r"))
    assert order == ["s", "r", "r", "s", "s", "r", "r", "s", "s", "r"]
    assert len(out["reference_step_times"]) == 4
    assert out["relative_step_time_spread"] >= 0 and out["relative_cpu_step_time_spread"] >= 0
    # too few pairs: no spread, rather than a "±0" that one pair would print
    assert median_spread([]) is None and median_spread([3.0]) is None and median_spread([1.0, 2.0, 3.0]) is None
    # 18 pairs (the full preset's): the median's interval runs from the 7th to the 12th smallest
    assert median_spread([float(i) for i in range(18, 0, -1)]) == pytest.approx((12 - 7) / 2)
    assert median_spread([1.0, 2.0, 3.0, 4.0]) == pytest.approx(1.5)  # 4 pairs: their whole range
    assert median_spread([1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == 0.0  # one outlier moves no median
    out = train_and_measure(Fake("s"), lambda: (None, None), 3, torch.device("cpu"), reference=Fake("r"))
    assert len(out["reference_step_times"]) == 1 and out["relative_step_time_spread"] is None


def test_the_overhead_carries_the_spread_of_both_rows():
    from llmmem.compare.report import _overhead_cell, derive

    def row(key, rel, spread):
        return {
            "key": key,
            "peak_bytes": 10,
            "activation_bytes": 5,
            "step_time": 0.1,
            "cpu_step_time": 0.1,
            "final_loss": 2.0,
            "relative_cpu_step_time": rel,
            "relative_cpu_step_time_spread": spread,
        }

    base, other = row("baseline", 1.0, 0.03), row("x", 1.2, 0.04)
    derive([base, other], timer="cpu")
    d = other["derived"]
    assert d["overhead_pct"] == pytest.approx(20.0)
    assert d["overhead_spread_pct"] == pytest.approx(100 * (0.04**2 + (1.2 * 0.03) ** 2) ** 0.5)
    assert _overhead_cell(d) == "+20% ±5"
    old = row("y", 1.1, None)  # too few pairs (or results.json written before spreads were recorded)
    derive([base, old], timer="cpu")
    assert _overhead_cell(old["derived"]) == "+10%"
    derive([row("baseline", 1.0, None), other], timer="cpu")  # the baseline's pairs too few
    assert _overhead_cell(other["derived"]) == "+20%"


def test_a_plan_beaten_by_a_uniform_row_at_no_more_memory_fails_its_target():
    from llmmem.compare.report import check_targets, derive

    def row(key, checkpoint, rel, act, amp="none", spread=0.01):
        return {
            "key": key,
            "label": key,
            "strategy": {"checkpoint": checkpoint, "amp": amp, "tp": 1, "dp": 1},
            "peak_bytes": 100 + act,
            "activation_bytes": act,
            "step_time": 0.1,
            "cpu_step_time": 0.1,
            "final_loss": 2.0,
            "relative_cpu_step_time": rel,
            "relative_cpu_step_time_spread": spread,
        }

    def verdict(rows):
        derive(rows, timer="cpu")
        (t,) = [t for t in check_targets(rows) if t["target"].startswith("no uniform plan beats")]
        return t["holds"], t["detail"]

    base = row("baseline", "none", 1.0, 100)
    # the case: the 25% plan at every-layer's memory, slower than llmmem's every layer
    holds, detail = verdict([base, row("every", "every", 1.11, 25), row("plan-25", "plan", 1.16, 25)])
    assert holds is False and "plan-25 +16.0%" in detail and "every +11.0%" in detail
    # the baseline's spread is common to both rows and excuses nothing
    rows = [
        row("baseline", "none", 1.0, 100, spread=0.05),
        row("every", "every", 1.11, 25),
        row("plan-25", "plan", 1.16, 25),
    ]
    assert verdict(rows)[0] is False
    # too few pairs for a spread (--quick): the medians alone decide nothing
    rows = [base, row("every", "every", 1.11, 25, spread=None), row("plan-25", "plan", 1.16, 25, spread=None)]
    holds, detail = verdict(rows)
    assert holds is None and "too few pairs" in detail
    # within the two rows' spreads (2 and 4 points): not beaten
    rows = [base, row("every", "every", 1.11, 25, spread=0.02), row("plan-25", "plan", 1.14, 25, spread=0.04)]
    assert verdict(rows)[0] is True
    # the uniform row needed more memory, or ran at another precision: no comparison
    assert verdict([base, row("every", "every", 1.11, 20), row("plan-25", "plan", 1.16, 19)])[0] is True
    assert verdict([base, row("every", "every", 1.11, 20, amp="bf16"), row("plan-25", "plan", 1.16, 25)])[0] is True
    assert verdict([base, row("every", "every", 1.11, 20)])[0] is None  # no plan row


def test_vocab_table_keeps_an_infeasible_rows_reason_out_of_its_columns_and_the_headline_says_a_lower_bound():
    from llmmem.compare.report import derive, headline, markdown, table

    def row(key, label, peak, largest=None, exact=True, **extra):
        r = {
            "key": key,
            "label": label,
            "preset": "vocab-quick",
            "world": 1,
            "model": {"seq_len": 128, "vocab_size": 32768},
            "batch": 2,
            "error": None,
            "peak_bytes": peak,
            "activation_bytes": peak // 2,
            "step_time": 0.2,
            "cpu_step_time": 0.1,
            "final_loss": 10.0,
            "relative_cpu_step_time": 1.0,
            "relative_cpu_step_time_spread": None,
        }
        if largest is not None:
            r["search"] = {"kind": "batch", "largest": largest, "exact": exact}
        return {**r, **extra}

    infeasible = row(
        "plan-50",
        "llmmem plan 50%, plain head",
        0,
        error="infeasible: auto_checkpoint: no plan fits",
        infeasible=True,
        plan={"least_budget_bytes": 100 << 20, "no_checkpoint_peak_bytes": 120 << 20},
    )
    rows = [
        row("baseline", "plain head, fp32 (baseline)", 140 << 20, largest=2),
        infeasible,
        row("fused+plan-50", "fused head + plan 50%", 32 << 20, largest=19, exact=False),
    ]
    derive(rows, timer="cpu")
    lines = table(rows).splitlines()
    assert lines[0].index("vs base") - lines[0].index("peak MiB") <= len("infeasible") + 2  # a narrow column
    assert lines[3].split() == ["llmmem", "plan", "50%,", "plain", "head", "infeasible"]
    assert lines[-1].startswith("llmmem plan 50%, plain head: infeasible: auto_checkpoint")
    md = markdown(rows)
    assert "| llmmem plan 50%, plain head | infeasible |" in md
    assert md.endswith("\n\nllmmem plan 50%, plain head: infeasible, least budget 100.00 MiB, 83% of 120.00 MiB.")
    assert "batch >=19 in the baseline's peak (9.5x)" in headline(rows)
    rows[2]["search"]["exact"] = True
    assert "batch 19 in the baseline's peak (9.5x)" in headline(rows)
