"""oom_report: out-of-memory errors (the tracker's simulated capacity, the CPU allocator's, torch's)
turned into a report raised with the original, the training state left to retry, and a top
suggestion that, applied, makes the failing step fit."""

from __future__ import annotations

import pickle

import pytest
import torch
from support.diagnostics import gpt_step, hf_model, tiny_gpt

import llmmem
from llmmem.diagnostics.oom import OutOfMemoryReportError
from llmmem.diagnostics.tracker import MemoryTracker


def _steady_peak(model, opt, batch: int) -> int:
    gpt_step(model, opt, batch)  # makes the optimizer state, so the next steps are alike
    with MemoryTracker(model, opt) as tracker:
        gpt_step(model, opt, batch)
    return tracker.peak_bytes()


def _snapshot(model, opt):
    return (
        [p.detach().clone() for p in model.parameters()],
        [v.clone() for s in opt.state.values() for v in s.values()],
    )


def test_budget_oom_report_and_its_top_suggestion_makes_the_step_fit():
    model, opt = tiny_gpt(layers=4)
    budget = int(0.8 * _steady_peak(model, opt, 8))
    before = _snapshot(model, opt)
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=budget):
            gpt_step(model, opt, 8)
    exc = info.value
    assert isinstance(exc, OutOfMemoryReportError) and isinstance(exc, MemoryError)
    assert isinstance(exc.__cause__, llmmem.OutOfMemoryError) and "budget" in str(exc.__cause__)
    report = exc.report
    text = str(exc)
    for part in ("out of memory in", "by category", "by module", "largest live tensors", "what would make it fit"):
        assert part in text, part
    assert report.capacity == budget
    assert report.failure["phase"] in ("forward", "backward") and report.failure["module"].startswith("GPT")
    # the training state is left to retry: parameters and optimizer state untouched, no gradients
    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
    assert all(p.grad is None for p in model.parameters())
    kinds = [s.kind for s in report.suggestions]
    assert "auto_checkpoint" in kinds and "batch" in kinds and "autocast" in kinds
    top = report.suggestions[0]
    assert top.fits and top.kind == "auto_checkpoint" and top.source == "planner"
    assert "llmmem.auto_checkpoint(model.blocks" in top.code
    # apply it exactly as printed, then the same step under the same capacity fits
    model.blocks = llmmem.auto_checkpoint(
        model.blocks, torch.randn(top.params["input_shape"]), budget=top.params["budget"]
    )
    with MemoryTracker(model, opt, budget=budget) as tracker:
        gpt_step(model, opt, 8)
    assert tracker.peak_bytes() <= budget
    # the batch suggestion fits too
    model2, opt2 = tiny_gpt(layers=4)
    gpt_step(model2, opt2, 8)
    batch = next(s for s in report.suggestions if s.kind == "batch").params["batch"]
    with MemoryTracker(model2, opt2, budget=budget) as tracker:
        gpt_step(model2, opt2, batch)


def test_as_a_decorator_with_a_leak_from_the_previous_step():
    model, opt = tiny_gpt()
    budget = int(1.15 * _steady_peak(model, opt, 4))
    history = []

    @llmmem.oom_report(model, opt, budget=budget)
    def train_step(batch):
        idx = torch.randint(0, 256, (batch, 64))
        logits, loss = model(idx, targets=idx)
        history.append(logits)  # the leak: every step's logits stay alive
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with pytest.raises(llmmem.OutOfMemoryError) as info:
        for _ in range(20):
            train_step(4)
    report = info.value.report
    assert report.failure["outlived"]["count"] >= 2
    assert "tensors that outlived the previous step" in str(info.value)
    leak = next(s for s in report.suggestions if s.kind == "free-outlived")
    assert leak.saves == report.failure["outlived"]["bytes"]
    history.clear()
    train_step(4)  # with the leak gone, the same decorated step runs


def test_cpu_allocator_error_keeps_its_type():
    with pytest.raises(RuntimeError) as info:
        with llmmem.oom_report():
            torch.empty(2**48, dtype=torch.uint8)  # 256 TiB: the CPU allocator refuses at once
    exc = info.value
    assert isinstance(exc, OutOfMemoryReportError)
    assert "DefaultCPUAllocator" in str(exc.__cause__)
    assert exc.report.failure["requested"] == 2**48
    assert exc.report.failure["op"] is not None  # seen by the tracker's operator hook


def test_torch_out_of_memory_error_keeps_its_type():
    """A CUDA out-of-memory error (raised here by hand: there is no GPU) is caught as torch's type."""
    model, opt = tiny_gpt()
    with pytest.raises(torch.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, capacity="64MiB"):
            gpt_step(model, opt, 2)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    exc = info.value
    assert isinstance(exc, OutOfMemoryReportError)
    assert type(exc.__cause__) is torch.OutOfMemoryError
    assert exc.report.capacity == 64 * 2**20
    assert "Tried to allocate 2.00 GiB" in str(exc)


def test_other_errors_pass_unchanged():
    model, opt = tiny_gpt()
    with pytest.raises(KeyError) as info:
        with llmmem.oom_report(model, opt):
            raise KeyError("x")
    assert type(info.value) is KeyError
    with llmmem.oom_report(model, opt) as rep:
        gpt_step(model, opt, 2)
    assert rep.report is None


def test_hugging_face_model_gets_gradient_checkpointing_advice():
    model = hf_model("gpt2")
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 256, (4, 64))
    with MemoryTracker(model, opt) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    opt.zero_grad(set_to_none=True)
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=int(0.7 * probe.peak_bytes())):
            model(input_ids=ids, labels=ids).loss.backward()
    kinds = [s.kind for s in info.value.report.suggestions]
    assert "gradient_checkpointing" in kinds
    assert any("checkpointing_enable()" in s.code for s in info.value.report.suggestions)
    assert info.value.report.failure["module"].startswith("GPT2LMHeadModel")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(model=3), TypeError, "model"),
        (dict(budget="x"), ValueError, "budget"),
        (dict(capacity=0), ValueError, "capacity"),
        (dict(batch=0), ValueError, "batch"),
        (dict(seq=1.5), ValueError, "seq"),
        (dict(plan="yes"), TypeError, "plan"),
        (dict(track=1), TypeError, "track"),
        (dict(budget="1GB", track=False), ValueError, "track"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        llmmem.oom_report(**kwargs)


@pytest.mark.cuda
def test_cuda_out_of_memory_report_under_a_memory_fraction():
    """A real CUDA out-of-memory error, on a device capped with set_per_process_memory_fraction."""
    model, opt = tiny_gpt(hidden=256, seq_len=128)
    model.cuda()
    opt = torch.optim.AdamW(model.parameters())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 64 * 2**20) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError) as info:
            with llmmem.oom_report(model, opt, plan=False):
                idx = torch.randint(0, 256, (256, 128), device="cuda")  # ~70 MiB of scores per layer
                _, loss = model(idx, targets=idx)
                loss.backward()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    exc = info.value
    assert isinstance(exc, OutOfMemoryReportError) and type(exc.__cause__) is torch.OutOfMemoryError
    failure = exc.report.failure
    assert failure["op"] and failure["requested"] and failure["cuda"]["reserved"] >= failure["cuda"]["allocated"]
    assert "reserved but free" in str(exc)
    assert exc.report.capacity_source.startswith("set_per_process_memory_fraction")
    assert all(p.grad is None for p in model.parameters())


def test_report_texts_name_the_step_or_say_it_was_outside_one():
    """The header and the "made in" lines of tensors kept from earlier steps: a step number inside a
    tracked step; "outside a tracked step" for what ran before the model's first forward under the
    report (the tracker's step -1), never "step -1"."""
    model, opt = tiny_gpt()
    budget = _steady_peak(model, opt, 2) + 2**20  # a step of batch 2 fits, one of batch 8 does not
    kept = []
    idx = torch.randint(0, 256, (2, 64))
    logits, loss = model(idx, targets=idx)  # its forward ran before the report, so its backward is outside a step
    logits.register_hook(lambda g: kept.append(g * 2))  # a tensor made in that backward, kept
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=budget, plan=False):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            logits, loss = model(idx, targets=idx)  # step 0
            kept.append(logits)  # made in the forward of step 0, kept
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del logits, loss
            gpt_step(model, opt, 8)  # step 1: out of memory
    text = str(info.value)
    assert info.value.report.failure["step"] == 1
    assert text.splitlines()[0].startswith("out of memory in ") and " (step 1" in text.splitlines()[0]
    made = [line for line in text.splitlines() if " made " in line and "float32" in line]
    assert any("made outside a tracked step, backward" in line for line in made), text
    assert any("made in step 0, forward of GPT" in line for line in made), text
    assert "step -1" not in text


def test_report_outside_any_step_says_so():
    with pytest.raises(RuntimeError) as info:
        with llmmem.oom_report():
            torch.empty(2**48, dtype=torch.uint8)  # refused by the CPU allocator, no model ever ran
    first = str(info.value).splitlines()[0]
    assert info.value.report.failure["step"] == -1
    assert first.startswith("out of memory in other (outside a tracked step, in aten.empty"), first


def test_tracker_peak_line_names_the_step_or_says_it_was_outside_one():
    model, opt = tiny_gpt()
    with MemoryTracker(model, opt) as outside:
        torch.ones(2**20).sum()  # 4 MiB, more than the model: the peak, with no step begun
    with MemoryTracker(model, opt) as inside:
        gpt_step(model, opt, 2)
    peak_lines = [next(line for line in t.table().splitlines() if line.startswith("peak ")) for t in (outside, inside)]
    assert peak_lines[0].endswith(": other, outside a tracked step"), peak_lines[0]
    assert inside.peak()["step"] == 0 and peak_lines[1].endswith(", step 0"), peak_lines[1]


def test_the_report_survives_tooling_that_rebuilds_exceptions():
    """What oom_report raises can be pickled (DataLoader workers, multiprocessing and torch's elastic
    agent send exceptions that way; its type is made at run time, which pickle could not find) and
    made again with two arguments, reading clearly."""
    model, opt = tiny_gpt()
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=2**20, plan=False):
            gpt_step(model, opt, 8)
    exc = info.value
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert isinstance(back, OutOfMemoryReportError) and isinstance(back, llmmem.OutOfMemoryError)
    assert str(back.report) == str(exc.report)
    again = type(exc)("out of memory", 4096)
    assert str(again) == "out of memory (4096)" and isinstance(again, MemoryError)
    for original in (torch.OutOfMemoryError, MemoryError):
        made = llmmem.diagnostics.oom._report_type(original)("out of memory", 4096)
        assert str(made) == "out of memory (4096)" and isinstance(made, original)
        assert str(pickle.loads(pickle.dumps(made))) == "out of memory (4096)"


@pytest.mark.parametrize("order", [("input_ids", "labels", "attention_mask"), ("labels", "input_ids")])
def test_an_encoder_decoder_s_decoder_length_is_its_labels_wherever_they_stand(order):
    # a dict of inputs in any order: the attention mask after the labels has the encoder's length
    transformers = pytest.importorskip("transformers", reason="needs transformers (optional)")
    config = transformers.T5Config(
        vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).train()
    opt = torch.optim.Adam(model.parameters())
    inputs = {
        "input_ids": torch.randint(0, 256, (4, 64)),
        "labels": torch.randint(0, 256, (4, 16)),
        "attention_mask": torch.ones(4, 64, dtype=torch.long),
    }
    batch = {key: inputs[key] for key in order}
    with MemoryTracker(model, opt) as probe:
        model(**batch, use_cache=False).loss.backward()
    opt.zero_grad(set_to_none=True)
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=int(0.7 * probe.peak_bytes())):
            model(**batch, use_cache=False).loss.backward()
    basis = info.value.report.basis
    assert basis["estimate"]["batch"] == 4 and basis["estimate"]["seq"] == 64, basis["estimate"]
    assert basis["estimate"]["target_seq"] == 16, basis["estimate"]
    expected = llmmem.estimate(model, batch=4, seq=64, target_seq=16, precision="fp32", device_type="cpu")
    assert basis["activations"] == expected.activations
