"""SequenceParallelGPT computes what the single-device GPT computes (loss and every gradient), with
the activations between the parallel layers split along the sequence."""

from __future__ import annotations

import pytest

from llmmem.parallel.ranks import run_ranks

pytestmark = pytest.mark.distributed


def _same_as_gpt(rank, world, checkpoint):
    import torch

    import llmmem
    import llmmem.parallel as tp
    from llmmem.models.gpt import GPT, GPTConfig

    tp.init(tensor_parallel_size=world)
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab_size=64, dropout=0.0)
    ref = GPT(cfg)
    tp_model = tp.TensorParallelGPT.from_gpt(ref)
    tp_keys = sorted(tp_model.state_dict())
    model = tp.SequenceParallelGPT(tp_model)
    assert sorted(model.state_dict()) == tp_keys  # a checkpoint of either loads into the other
    if checkpoint:
        for block in model.blocks:
            inner = type(block).forward.__get__(block)
            block.forward = lambda x, inner=inner: llmmem.checkpoint(inner, x)
    idx, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    _, loss_ref = ref(idx, y)
    loss_ref.backward()
    with torch.no_grad():
        assert model.tok_emb(idx).shape == (3, 16 // world, 32)  # this rank's slice of the sequence
    _, loss = model(idx, y)
    loss.backward()
    assert tp.allreduce_sequence_parallel_grads(model) > 0
    assert torch.allclose(loss, loss_ref, rtol=1e-6, atol=0)
    ref_params = dict(ref.named_parameters())
    t = world
    for name, p in model.named_parameters():
        g_ref = ref_params[name].grad
        if p.shape == g_ref.shape:  # replicated: the whole gradient on every rank
            assert torch.allclose(p.grad, g_ref, rtol=1e-4, atol=1e-6), name
        else:  # split: this rank's rows or columns of the whole gradient
            dim = getattr(p, "tensor_parallel_dim", 0)
            if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
                continue  # q/k/v rows are regrouped by head before splitting (checked by loss and the rest)
            want = g_ref.chunk(t, dim=dim)[rank]
            assert torch.allclose(p.grad, want, rtol=1e-4, atol=1e-6), name
    tp.destroy()


@pytest.mark.parametrize("checkpoint", [False, True])
def test_sequence_parallel_gpt_matches_gpt(checkpoint):
    run_ranks(__file__, "_same_as_gpt", 2, args=(checkpoint,), timeout=120)


def test_needs_a_tensor_parallel_model():
    from llmmem.models.gpt import GPT, GPTConfig
    from llmmem.parallel import SequenceParallelGPT

    with pytest.raises(TypeError, match="TensorParallelGPT"):
        SequenceParallelGPT(GPT(GPTConfig(layers=1, hidden=8, heads=2, seq_len=4, vocab_size=8)))
