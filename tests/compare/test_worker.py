"""Each strategy trained and measured in its own process, as ``python -m llmmem compare`` runs it,
on a small GPT: fp32 checkpointing is exact, the techniques save what they should, the searches
find real largest fits, and the parallel rows train the same model as the baseline."""

from __future__ import annotations

import pytest

from llmmem.compare.cli import WorkerServer, run_strategy
from llmmem.compare.report import check_targets, derive
from llmmem.compare.strategies import STRATEGIES

MODEL = dict(layers=4, hidden=32, heads=2, seq_len=64, vocab_size=256, dropout=0.0)
BY_KEY = {s.key: s for s in STRATEGIES}


def _spec(key, baseline=None, **extra):
    spec = dict(
        strategy=BY_KEY[key].to_dict(),
        model=MODEL,
        batch=2,
        steps=3,
        seed=0,
        lr=1e-3,
        threads=1,
        device="cpu",
        search_trials=2,
    )
    if baseline is not None:
        spec.update(cap_bytes=baseline["peak_bytes"], baseline_activation_bytes=baseline["activation_bytes"])
    spec.update(extra)
    return spec


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    row = run_strategy(_spec("baseline"), str(tmp_path_factory.mktemp("base")), timeout=300)
    assert row["error"] is None, row.get("log")
    return row


def _run(key, baseline, tmp_path, **extra):
    row = run_strategy(_spec(key, baseline, **extra), str(tmp_path), timeout=300)
    assert row["error"] is None, row.get("log")
    return row


def test_baseline_measures_itself(baseline):
    assert len(baseline["losses"]) == 3 and baseline["losses"][-1] < baseline["losses"][0]
    assert baseline["peak_bytes"] >= baseline["start_bytes"] + baseline["activation_bytes"]
    # its own peak is the cap: its batch fits, one more does not (both measured)
    s = baseline["search"]
    assert s["kind"] == "batch" and s["largest"] == 2 and s["exact"]
    assert baseline["timeline"] and set(baseline["phases"]) == {"forward", "backward", "optimizer"}
    # each timed step is paired with a step of the fp32 reference, timed the same way
    assert len(baseline["reference_cpu_step_times"]) == len(baseline["cpu_step_times"]) == 1
    assert baseline["relative_cpu_step_time"] > 0 and baseline["relative_step_time"] > 0


def test_a_forked_worker_measures_what_a_fresh_process_measures(baseline, tmp_path):
    # the worker server imports torch once and forks a child per strategy: nothing of one run (or
    # of the server) is in the next; the figures are the fresh process's
    server = WorkerServer(1, str(tmp_path))
    try:
        rows = [run_strategy(_spec("baseline"), str(tmp_path), timeout=300, server=server) for _ in range(2)]
        bad = run_strategy(_spec("baseline", model=dict(MODEL, heads=3)), str(tmp_path), timeout=300, server=server)
        again = run_strategy(_spec("baseline"), str(tmp_path), timeout=300, server=server)  # still serving
        server_pid = server.proc.pid
    finally:
        server.close()
    for row in rows + [again]:
        assert row["error"] is None, row.get("log")
        for k in ("losses", "peak_bytes", "start_bytes", "activation_bytes", "search"):
            assert row[k] == baseline[k], k
        assert row["parent_pid"] == server_pid  # forked from the server: no interpreter start or import
        assert set(row["seconds"]) >= {"start", "build", "train", "search"}
    assert bad["error"] and "heads" in bad["log"] and "Traceback" in bad["log"]  # the child's own error


def test_a_worker_that_times_out_is_killed_and_the_server_restarts(tmp_path):
    server = WorkerServer(1, str(tmp_path))
    try:
        row = run_strategy(_spec("baseline", steps=10**6), str(tmp_path), timeout=20, server=server)
        assert row["error"] and "timed out" in row["log"]
        assert server.proc is None  # killed with its child (its own process group)
        assert server.request({"cuda_check": True, "log": str(tmp_path / "c.log")}, timeout=120) in (0, 3)
    finally:
        server.close()


@pytest.mark.parametrize("key", ["every", "selective"])
def test_fp32_checkpointing_is_exact_and_saves_memory(key, baseline, tmp_path):
    row = _run(key, baseline, tmp_path)
    assert row["losses"] == baseline["losses"]  # bit for bit
    assert row["start_bytes"] == baseline["start_bytes"]
    assert row["activation_bytes"] < 0.8 * baseline["activation_bytes"]
    s = row["search"]
    assert s["largest"] > 2  # a larger batch fits in the baseline's peak, measured
    fit = dict(map(tuple, s["trials"]))
    assert fit.get(s["largest"], 0) <= s["cap_bytes"]
    if s["exact"]:
        assert fit[s["largest"] + 1] > s["cap_bytes"]


def test_plan_row_has_a_budget_and_trains_exactly(baseline, tmp_path):
    row = _run("plan-50", baseline, tmp_path)
    assert row["losses"] == baseline["losses"]
    plan = row["plan"]
    assert plan["budget_bytes"] == int(0.5 * baseline["activation_bytes"])
    assert plan["least_budget_bytes"] <= plan["budget_bytes"] and "budget" in plan["describe"]
    assert row["activation_bytes"] < baseline["activation_bytes"]
    s = row["search"]  # the planner, given the baseline's memory, fits a larger batch
    assert s["largest"] is not None and s["largest"] > 2


def test_mixed_precision_rows(baseline, tmp_path):
    bf16 = _run("bf16", baseline, tmp_path)
    assert bf16["activation_bytes"] < 0.8 * baseline["activation_bytes"]
    assert abs(bf16["final_loss"] - baseline["final_loss"]) < 1e-2 * baseline["final_loss"]
    fp16 = _run("fp16", baseline, tmp_path)
    assert abs(fp16["final_loss"] - baseline["final_loss"]) < 1e-2 * baseline["final_loss"]


def test_infeasible_plan_is_a_row_error_not_a_crash(baseline, tmp_path):
    # a budget far below what one block needs: the row says what the least feasible budget is
    row = run_strategy(_spec("plan-25", dict(baseline, activation_bytes=1000)), str(tmp_path), timeout=300)
    assert row["infeasible"] and "smallest feasible budget" in row["error"]


@pytest.mark.distributed
def test_tp2_x_dp2_zero1_trains_the_baseline_model_per_rank(baseline, tmp_path):
    row = _run("tp2xdp2+zero1", baseline, tmp_path)
    assert row["world"] == 4 and len(row["per_rank"]) == 4
    for a, b in zip(row["losses"], baseline["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert row["params"] == baseline["params"] and row["params_per_rank"] < 0.6 * baseline["params"]
    assert row["peak_bytes_max_rank"] < baseline["peak_bytes"]
    s = row["search"]
    assert s["kind"] == "layers" and s["largest"] > MODEL["layers"]
    assert row["search"]["largest_params"] > baseline["params"]


@pytest.mark.distributed
@pytest.mark.parametrize("key, world", [("zero3", 2), ("tp2xzero3", 4)])
def test_zero3_rows_train_the_baseline_and_shard_its_state(baseline, tmp_path, key, world):
    row = _run(key, baseline, tmp_path)
    assert row["world"] == world and len(row["per_rank"]) == world
    for a, b in zip(row["losses"], baseline["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    whole = baseline["state_bytes"]
    assert whole["parameters"] > 0 and whole["gradients"] == whole["parameters"]
    for rank in row["per_rank"]:  # each rank holds its 1/world of every part of the model state
        for kind, part in rank["state_bytes"].items():
            assert 0 < part <= (1 / world + 0.05) * whole[kind], (rank["rank"], kind, part, whole[kind])
    assert row["params_per_rank"] <= (1 / world + 0.05) * row["params"]
    report = {r["target"]: r["holds"] for r in check_targets(derive([dict(baseline), dict(row)]))}
    assert [holds for target, holds in report.items() if target.startswith(row["label"])] == [True]


@pytest.mark.cuda
def test_rows_on_cuda_use_the_allocator_figures(tmp_path):
    base = run_strategy(_spec("baseline", device="cuda"), str(tmp_path), timeout=300)
    assert base["error"] is None, base.get("log")
    assert base["device"].startswith("cuda") and base["reserved_peak_bytes"] >= base["peak_bytes"]
    row = run_strategy(_spec("every+bf16", base, device="cuda"), str(tmp_path), timeout=300)
    assert row["error"] is None, row.get("log")
    assert row["activation_bytes"] < 0.5 * base["activation_bytes"]
    assert row["search"]["largest"] > base["search"]["largest"]
