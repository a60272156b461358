"""``llmmem.patch_lm_loss`` in training: under ``transformers.Trainer`` with gradient accumulation
(``num_items_in_batch``) the losses and weights are the unpatched run's; with ``auto_checkpoint``,
planned before or after the patch, the gradients are the unpatched model's; and the step's peak
(live tensor bytes, measured) drops by more than the logits when they dominate."""

from __future__ import annotations

import pytest
import torch
from support.lm_loss import VOCAB, assert_same_grads, batch, build, run, transformers_or_skip

import llmmem
from llmmem.diagnostics.live import LiveBytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Examples(torch.utils.data.Dataset):
    """Sequences of 10 tokens whose first 0..6 labels are ignored (a prompt), so the micro-batches of a
    step hold different numbers of tokens and the mean over each would not be the step's mean."""

    def __init__(self, n: int = 8) -> None:
        g = torch.Generator().manual_seed(5)
        self.rows = []
        for i in range(n):
            ids = torch.randint(3, VOCAB, (10,), generator=g)
            labels = ids.clone()
            labels[: (i * 5) % 7] = -100
            self.rows.append({"input_ids": ids, "labels": labels})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _train(tmp_path, patched: bool):
    transformers = transformers_or_skip()
    model = build("llama").train()  # no dropout in the config: the two runs compare
    handle = llmmem.patch_lm_loss(model) if patched else None
    seen, losses, logits = [], [], []
    model.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("num_items_in_batch")), with_kwargs=True)

    def record(module, args, out):
        losses.append(out.loss.item())
        logits.append(out.logits)

    model.register_forward_hook(record)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"patched-{patched}"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-2,
        optim="sgd",  # linear in the gradient: the runs stay as close as the gradients are
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Examples())
    trainer.train()
    assert all((t is None) == patched for t in logits)
    if handle is not None:
        handle.remove()
    return losses, seen, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_with_gradient_accumulation_matches_unpatched(tmp_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    want_losses, want_items, want_params = _train(tmp_path, patched=False)
    got_losses, got_items, got_params = _train(tmp_path, patched=True)
    assert len(got_losses) == 4  # 2 steps x 2 micro-batches
    # the Trainer passed num_items_in_batch (the step's token count), to both alike
    assert all(n is not None for n in got_items) and [int(n) for n in got_items] == [int(n) for n in want_items]
    assert got_losses == pytest.approx(want_losses, rel=1e-5)
    for name, p in want_params.items():
        torch.testing.assert_close(got_params[name], p, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("order", ["patch then plan", "plan then patch"])
def test_auto_checkpoint_gradients_equal_unpatched(order):
    ids, labels = batch(s=32)
    _, want = run(build("llama", num_hidden_layers=4), input_ids=ids, labels=labels, use_cache=False)
    model = build("llama", num_hidden_layers=4)
    sample = {"input_ids": ids, "labels": labels, "use_cache": False}
    if order == "patch then plan":
        handle = llmmem.patch_lm_loss(model)
        plan = llmmem.auto_checkpoint(model, budget=0.6, sample=sample, repeats=0)
    else:
        plan = llmmem.auto_checkpoint(model, budget=0.6, sample=sample, repeats=0)
        handle = llmmem.patch_lm_loss(model)
    assert plan.regions or set(plan.modes) != {"store-all"}  # something is recomputed
    out, got = run(model, **sample)
    assert out.logits is None
    assert_same_grads(got, want)
    handle.remove()
    plan.remove()
    _, again = run(model, **sample)
    assert_same_grads(again, want)


def _step_peak(model, ids, labels):
    """(peak live bytes of one forward and backward above what existed before, loss, gradients)."""
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        live.track([model, ids, labels])
        base = live.allocated()
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        peak = live.max_allocated() - base
    return peak, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_peak_drops_by_more_than_the_logits():
    vocab = 32000
    model = build(
        "llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        max_position_embeddings=256,
    )
    ids, labels = batch(b=2, s=256)
    logits = ids.numel() * vocab * 4  # fp32 [tokens, vocab]: 65.5 MB
    plain_peak, plain_loss, plain_grads = _step_peak(model, ids, labels)
    with llmmem.patch_lm_loss(model):
        fused_peak, fused_loss, fused_grads = _step_peak(model, ids, labels)
    assert plain_peak - fused_peak >= 1.5 * logits, (plain_peak, fused_peak, logits)
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=0)
    assert_same_grads(fused_grads, plain_grads)


def test_remove_after_a_bf16_trainer_keeps_accelerates_autocast(tmp_path):
    # Trainer(bf16=True) wraps the patched forward in accelerate's autocast wrapper: remove()
    # switches the patch off inside it rather than dropping the autocast the Trainer relies on
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    transformers = transformers_or_skip()
    from accelerate.utils import extract_model_from_parallel

    model = build("llama").train()
    handle = llmmem.patch_lm_loss(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        bf16=True,
        optim="sgd",
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    transformers.Trainer(model=model, args=args, train_dataset=_Examples(2)).train()
    wrapper = model.__dict__["forward"]
    handle.remove()
    assert "removed" in repr(handle) and model.__dict__["forward"] is wrapper
    head_dtypes = []
    model.lm_head.register_forward_hook(lambda m, a, out: head_dtypes.append(out.dtype))
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.shape == (*ids.shape, VOCAB)
    assert head_dtypes == [torch.bfloat16]  # accelerate's autocast still on
    with llmmem.patch_lm_loss(model):  # patchable again, over accelerate's wrapper
        assert model(input_ids=ids, labels=labels).logits is None
    extract_model_from_parallel(model, keep_fp32_wrapper=False)  # accelerate's own unwrap: the switched-off patch
    handle.remove()  # now takes it out as well
    assert "forward" not in model.__dict__ and model(input_ids=ids, labels=labels).logits is not None
