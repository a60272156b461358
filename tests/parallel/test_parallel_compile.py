"""Tensor parallelism under ``torch.compile(fullgraph=True)``, 2 gloo ranks: a Hugging Face Llama
split by ``llmmem.parallel.parallelize`` (with and without sequence parallelism) and llmmem's
``TensorParallelGPT``, compiled (aot_eager), are one graph each and give the loss and gradients of
the eager split model. llmmem's collectives are custom operators under Dynamo (before, each was a
graph break, and Dynamo refused ``fullgraph=True``). No test helper imports here: the ranks load
this file by path."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.distributed


def _compiled_equals_eager(build, step) -> None:
    eager = build()
    want_loss = step(eager, eager)
    want = [p.grad.clone() for p in eager.parameters()]
    model = build()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # the second runs the compiled graph as it is
        for p in model.parameters():
            p.grad = None
        loss = step(compiled, model)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
        for p, g in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def _ranks(rank, world):
    import transformers

    import llmmem.parallel as tp
    from llmmem.models.gpt import GPT, GPTConfig

    warnings.filterwarnings("ignore")
    tp.init(tensor_parallel_size=world)
    group = tp.get_tensor_parallel_group()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def llama(sequence_parallel):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(cfg).train()
        tp.parallelize(model, group, sequence_parallel=sequence_parallel)
        return model

    for sequence_parallel in (False, True):

        def llama_step(run, model):
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            if sequence_parallel:  # the norms' gradients, partial on each rank's slice of the sequence
                tp.allreduce_sequence_parallel_grads(model)
            return loss.detach()

        _compiled_equals_eager(lambda: llama(sequence_parallel), llama_step)
        torch._dynamo.reset()

    # a new sequence length is a new shape, not a new graph each time: the sequence-parallel hooks'
    # stored length was guarded on as a constant (fullgraph=True stopped at Dynamo's recompile limit)
    from torch._dynamo.utils import counters

    counters.clear()
    model = llama(True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for seq in (16, 18, 20, 22):
        batch = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seq))
        compiled(input_ids=batch, labels=batch).loss.backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch._dynamo.reset()

    def gpt():
        torch.manual_seed(0)
        full = GPT(GPTConfig(layers=2, hidden=32, heads=2, seq_len=16, vocab_size=128, dropout=0.0))
        return tp.TensorParallelGPT.from_gpt(full, process_group=group)

    def gpt_step(run, model):
        _, loss = run(ids, ids)
        loss.backward()
        return loss.detach()

    _compiled_equals_eager(gpt, gpt_step)
    tp.destroy()


def test_compiled_tensor_parallel_models_train_as_eager():
    pytest.importorskip("transformers", reason="the Hugging Face model needs transformers (optional)")
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_ranks", 2, timeout=240)


def _one_rank(rank, world):
    """A group of one rank: every collective is the identity, compiled as eagerly; misuse is refused
    under compile as it is eagerly."""
    import torch.distributed as dist

    from llmmem.parallel import collectives

    warnings.filterwarnings("ignore")
    t = torch.arange(12.0).reshape(3, 4)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        # a transposed (non-contiguous) input, given back by a one-rank gather: the operator's output
        # has the contiguous strides its fake promised (inductor asserted on them)
        gather = torch.compile(lambda x: collectives.all_gather(x.t(), 0) + 1, backend=backend, fullgraph=True)
        torch.testing.assert_close(gather(t), t.t() + 1, rtol=0, atol=0)
        scatter = torch.compile(lambda x: collectives.reduce_scatter(x.t(), 1) * 2, backend=backend, fullgraph=True)
        torch.testing.assert_close(scatter(t), t.t() * 2, rtol=0, atol=0)
    torch._dynamo.reset()
    for dim in (2, -3):  # out of range: the eager error, not a gather along another dimension
        with pytest.raises(ValueError, match="out of range"):
            torch.compile(lambda x, d=dim: collectives.all_gather(x, d), backend="aot_eager")(t)
    ones = torch.ones(2, 3, requires_grad=True)
    out = torch.compile(lambda x: collectives.all_gather(x, 0), backend="aot_eager", fullgraph=True)(ones)
    assert not out.requires_grad  # data movement, detached as the eager call's result
    dist.barrier()


def test_collectives_of_one_rank_compile_as_eager():
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_one_rank", 1, timeout=300)


def test_a_compiled_collective_without_torch_distributed_says_so():
    from llmmem.errors import StateError
    from llmmem.parallel import collectives

    torch._dynamo.reset()
    with pytest.raises(StateError, match="not initialized"):
        torch.compile(lambda x: collectives.all_reduce(x), backend="aot_eager")(torch.ones(2))
