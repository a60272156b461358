"""``torch.compile`` of a model patched with ``llmmem.patch_lm_loss``: one graph (``fullgraph=True``,
no graph break) holding the fused head's op, with the eager patched model's loss and gradients
(llmmem's GPT and a Hugging Face Llama, CPU, backend ``aot_eager``; ``inductor`` gives the same,
checked by hand: it compiles for 30-50 s here, too slow for the suite). Also the life of the
patch's pre-hook on the head, which makes that possible: on while patched, acting only during a
call with labels, moved to a head that replaces the model's, gone after ``remove``."""

from __future__ import annotations

import pytest
import torch
from support.lm_loss import VOCAB, assert_same_grads, batch, build
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import llmmem
from llmmem.head.patch import _Capture
from llmmem.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(family: str):
    """(model, forward's keyword arguments with labels, the loss of its output)."""
    if family == "gpt":
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=300, hidden=32, layers=2, heads=4, seq_len=16, dropout=0.0))
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
        return model, {"idx": ids, "targets": ids}, lambda out: out[1]
    model = build(family)
    ids, labels = batch()
    return model, {"input_ids": ids, "labels": labels}, lambda out: out.loss


def _step(model, kwargs, loss_of, params):
    for p in params.values():
        p.grad = None
    loss = loss_of(model(**kwargs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in params.items() if p.grad is not None}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_compiled_patched_model_is_one_graph_with_the_eager_loss_and_gradients(family):
    model, kwargs, loss_of = _model(family)
    params = dict(model.named_parameters())
    handle = llmmem.patch_lm_loss(model)
    want, want_grads = _step(model, kwargs, loss_of, params)
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fullgraph: a graph break raises
    got, got_grads = _step(compiled, kwargs, loss_of, params)
    assert not counters["graph_break"] and backend.frame_count == 1
    assert "llmmem.lce_grads" in backend.graphs[0].code  # the fused op, not logits, in the graph
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert_same_grads(got_grads, want_grads)
    if family == "gpt":  # without labels: the head's logits, as eager (a second graph for the new call)
        logits = compiled(kwargs["idx"])[0]
        torch.testing.assert_close(logits, model(kwargs["idx"])[0], rtol=1e-6, atol=1e-6)
        assert logits.shape == (2, 16, 300) and not counters["graph_break"]
    handle.remove()
    torch._dynamo.reset()


def _captures(module: torch.nn.Module) -> list:
    return [h for h in module._forward_pre_hooks.values() if isinstance(h, _Capture)]


def test_the_head_hook_is_on_while_patched_acts_only_with_labels_and_follows_a_new_head():
    model = build("llama")
    ids, labels = batch()
    handle = llmmem.patch_lm_loss(model)
    old = model.lm_head
    (hook,) = _captures(old)
    assert model(input_ids=ids).logits.shape == (2, 12, VOCAB)  # without labels it leaves the head alone
    assert model(input_ids=ids, labels=labels).logits is None  # disarmed after, holding nothing
    assert not hook.open and hook.hidden is None
    torch.manual_seed(3)
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=False)  # as resize_token_embeddings replaces it
    logits = model(input_ids=ids).logits  # the new head's own logits (the hook is still on the old one)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, want, rtol=1e-5, atol=0)
    assert _captures(old) == [] and _captures(model.lm_head) == [hook]
    handle.remove()
    assert not any(_captures(m) for m in model.modules())
