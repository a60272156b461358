"""A model planned by auto_checkpoint is an ordinary module: saved and loaded whole (torch.save /
torch.load, pickle), deep-copied, its state_dict keys its own; the copy runs the plan on its own
blocks, with the loss, gradients and peak of the original, bitwise. Hugging Face Llama and GPT-2
(small configs, random weights, dropout on); skipped without ``transformers``."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from support.planner import grads, lm_batch, same_grads, step_memory, tiny_gpt2, tiny_llama, transformers_or_skip

import llmmem

transformers_or_skip()

BUILDERS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def _torch_roundtrip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # a whole module is not weights only


COPIES = {
    "torch.save": _torch_roundtrip,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "deepcopy": copy.deepcopy,
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*caching is incompatible.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def _step(model, batch, seed=5):
    def step():
        torch.manual_seed(seed)  # the same dropout masks in every model
        model(**batch).loss.backward()

    return step


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_copy_runs_the_plan_on_its_own_blocks_with_the_same_loss_gradients_and_peak(kind, how):
    batch = lm_batch(seq=32)
    model = BUILDERS[kind]("eager", layers=4)
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=0)
    keys = list(model.state_dict())
    loss, g = _run(model, batch)
    peak = step_memory(model, _step(model, batch))[0]

    twin = COPIES[how](model)
    assert list(twin.state_dict()) == keys
    found = llmmem.AutoCheckpointPlan.of(twin)
    assert found is not None and found is not plan and found.active
    blocks = found.runner.blocks
    assert all(b is not o for b, o in zip(blocks, plan.runner.blocks))  # its own blocks, not the original's
    assert set(map(id, blocks)) <= {id(m) for m in twin.modules()}
    assert found.modes == plan.modes and found.regions == plan.regions

    twin_loss, twin_g = _run(twin, batch)
    assert torch.equal(twin_loss, loss) and same_grads(twin_g, g)
    assert step_memory(twin, _step(twin, batch))[0] == peak  # the plan's peak, not the plain model's

    # the original is untouched by its copy's steps, and each plan is removed alone
    assert same_grads(_run(model, batch)[1], g)
    found.remove()
    assert llmmem.AutoCheckpointPlan.of(twin) is None and llmmem.AutoCheckpointPlan.of(model) is plan
    assert all("forward" not in b.__dict__ for b in blocks)
    assert same_grads(_run(twin, batch)[1], g)  # plainly, the same gradients
    assert step_memory(twin, _step(twin, batch))[0] > peak
    plan.remove()


def test_a_loaded_model_is_planned_again_once_its_plan_is_removed():
    batch = lm_batch(seq=32)
    model = tiny_llama("eager", layers=4)
    llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=0)
    twin = _torch_roundtrip(model)
    with pytest.raises(ValueError, match=r"AutoCheckpointPlan\.of\(model\)"):
        llmmem.auto_checkpoint(twin, budget=0.4, sample=batch, repeats=0)
    llmmem.AutoCheckpointPlan.of(twin).remove()
    again = llmmem.auto_checkpoint(twin, budget=0.4, sample=batch, repeats=0)
    assert llmmem.AutoCheckpointPlan.of(twin) is again
    again.remove()


def test_save_pretrained_keeps_the_weights_and_not_the_plan(tmp_path):
    transformers = transformers_or_skip()
    batch = lm_batch(seq=32)
    model = tiny_llama("eager", layers=4)
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=0)
    _, g = _run(model, batch)
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").train()
    assert llmmem.AutoCheckpointPlan.of(loaded) is None
    assert same_grads(_run(loaded, batch)[1], g)
    plan.remove()
