"""The recording step of ``auto_checkpoint`` (one real step with the blocks run without a graph):
what a block makes for later blocks is profiled as needing a gradient when it would (T5's position
bias), and one updated in place by them is refused clearly; inputs that existed before the step are not counted as
the step's; and no block's graph outlives its call (Hugging Face's output capture of a mixture of
experts' router logits)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from support.planner import transformers_or_skip

import llmmem


class _Block(nn.Module):
    def __init__(self, first: bool, h: int = 32, in_place: bool = True):
        super().__init__()
        self.lin = nn.Linear(h, h)
        self.bias_proj = nn.Linear(h, h) if first else None
        self.in_place = in_place

    def forward(self, x, bias=None, ctx=None):
        if bias is None:
            bias = self.bias_proj(x)  # made by the first block for the others; needs a gradient
        elif self.in_place:
            bias.mul_(0.5)  # a later block updates it in place, as eager autograd allows
        y = x + torch.tanh(self.lin(x)) + bias
        if ctx is not None:
            y = y * ctx[:, :1, : y.shape[-1]].mean()
        return y, bias


class _Model(nn.Module):
    def __init__(self, in_place: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block(i == 0, in_place=in_place) for i in range(4))
        self.head = nn.Linear(32, 1)

    def forward(self, x, ctx=None):
        bias = None
        for b in self.blocks:
            x, bias = b(x, bias, ctx)
        return self.head(x).sum()


def test_a_side_output_updated_in_place_by_later_blocks_is_refused_clearly():
    """The recording runs it (the copies it updates are not leaves); the blocks that read it cannot
    be recomputed, which the profile finds: a clear refusal, not a crash in backward later."""
    model = _Model()
    x = torch.randn(8, 16, 32)
    with pytest.raises(ValueError, match=r"block 1 \(_Block\) updates in place an input that needs a gradient"):
        llmmem.auto_checkpoint(model, budget=0.6, sample=lambda: model(x).backward(), repeats=0)
    assert llmmem.AutoCheckpointPlan.of(model) is None and all(p.grad is None for p in model.parameters())


def test_inputs_made_before_the_step_are_not_the_steps():
    """A large input made before the step (precomputed embeddings) is the batch's, outside the
    budget, not a tensor the blocks make for each other."""
    model = _Model(in_place=False)
    x, ctx = torch.randn(8, 16, 32), torch.randn(8, 4096, 64)
    plan = llmmem.auto_checkpoint(model, budget=1.0, sample=lambda: model(x, ctx).backward(), repeats=0)
    assert plan.profile.static_bytes < ctx.numel() * ctx.element_size() / 100


def test_no_block_graph_outlives_the_recording_with_captured_router_logits():
    transformers = transformers_or_skip()
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        max_position_embeddings=128,
    )
    model = transformers.MixtralForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, 64))
    reached = set()
    recording = {"on": True}
    for name, p in model.named_parameters():
        if ".layers." in name:
            p.register_hook(lambda g, n=name: reached.add(n) if recording["on"] else None)

    def sample():  # the recording step: a backward through a block's own graph would reach its weights
        model(input_ids=ids, labels=ids).loss.backward()
        recording["on"] = False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = llmmem.auto_checkpoint(model, budget=0.6, sample=sample, repeats=0)
    assert plan.active
    assert reached == set(), sorted(reached)[:4]
