"""llmmem.optim.step_in_backward under transformers' Trainer (with accelerate): with clipping off
(max_grad_norm=0) the Trainer still calls clip_grad_norm_(params, inf) to log the gradient norm;
that is answered from the norms the hooks recorded, and the run trains, logs and ends as the same
run stepping after backward. A finite max_grad_norm stays refused."""

from __future__ import annotations

import pytest
import torch

import llmmem.optim as lo
from llmmem.errors import StateError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model():
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return transformers.Qwen3ForCausalLM(cfg)


def _train(tmp_path, in_backward: bool, max_grad_norm: float = 0.0):
    model = _model()
    ids = torch.randint(0, 96, (6, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in ids]
    opt = lo.AdamW(model.parameters(), lr=1e-2, seed=3)
    handle = lo.step_in_backward(model, opt) if in_backward else None
    args = transformers.TrainingArguments(
        str(tmp_path / ("sib" if in_backward else "after")),
        per_device_train_batch_size=2,
        max_steps=3,
        logging_steps=1,
        max_grad_norm=max_grad_norm,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    try:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
        trainer.train()
    finally:
        if handle is not None:
            handle.remove()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    return logs, model


def test_trainer_logs_the_same_grad_norm_and_trains_as_stepping_after(tmp_path):
    after, m_after = _train(tmp_path, in_backward=False)
    inside, m_inside = _train(tmp_path, in_backward=True)
    assert len(after) == len(inside) == 3
    for (loss_a, norm_a), (loss_i, norm_i) in zip(after, inside):
        assert loss_i == loss_a
        assert norm_i == pytest.approx(norm_a, rel=1e-6) and norm_a > 0
    for pa, pi in zip(m_after.parameters(), m_inside.parameters()):
        assert torch.equal(pa, pi)


def test_trainer_with_clipping_is_refused(tmp_path):
    with pytest.raises(StateError, match=r"max_norm=1\.0"):
        _train(tmp_path, in_backward=True, max_grad_norm=1.0)
