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
