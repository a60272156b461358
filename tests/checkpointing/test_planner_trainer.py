"""A planned Hugging Face model under ``transformers.Trainer``: the losses and the weights after
training are bitwise the unplanned model's, also with ``gradient_checkpointing=True`` (which the
plan turns off again: the layers are recomputed by the plan alone). Skipped without transformers
or accelerate (optional test dependencies)."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.planner import lm_batch, tiny_llama, transformers_or_skip

import llmmem

transformers = transformers_or_skip()
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")


class _Batches(torch.utils.data.Dataset):
    def __init__(self, n: int = 8) -> None:
        ids = lm_batch(seed=3, batch=n, seq=32)["input_ids"]
        self.rows = [{"input_ids": row, "labels": row} for row in ids]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _train(tmp_path, name: str, plan: bool, hf_checkpointing: bool):
    model = tiny_llama("sdpa", layers=4, dropout=0.1)  # dropout on: the recompute must replay it
    planned = None
    if plan:
        planned = llmmem.auto_checkpoint(model, budget=0.5, sample=lm_batch(batch=2, seq=32), repeats=0)
    losses = []
    model.register_forward_hook(lambda m, a, out: losses.append(out.loss.item()))
    # transformers 5 renamed the switch (the old name still works, deprecated)
    fields = transformers.TrainingArguments.__dataclass_fields__
    switch = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **{switch: hf_checkpointing},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformers.Trainer(model=model, args=args, train_dataset=_Batches()).train()
    said = [w for w in caught if "enabled on the planned blocks" in str(w.message)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, said, planned


@pytest.mark.parametrize("hf_checkpointing", [False, True])
def test_a_planned_model_trains_under_trainer_as_unplanned(tmp_path, hf_checkpointing):
    want_losses, want_params, _, _ = _train(tmp_path, "plain", plan=False, hf_checkpointing=False)
    losses, params, said, planned = _train(tmp_path, "planned", plan=True, hf_checkpointing=hf_checkpointing)
    assert planned.active and len(planned.regions) + sum(m != "store-all" for m in planned.modes) > 0
    assert len(losses) == 3 and losses == want_losses
    for name, p in want_params.items():
        assert torch.equal(params[name], p), name
    assert len(said) == (1 if hf_checkpointing else 0)
