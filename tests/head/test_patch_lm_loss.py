"""``llmmem.patch_lm_loss`` on every Hugging Face family it supports (tiny random configs, nothing
downloaded) and on llmmem's GPT: the patched loss and every gradient equal the unpatched model's
(fp32), ``logits`` is None with labels and the same logits come back without them, Hugging Face's
loss arguments (ignored rows, ``num_items_in_batch``, ``logits_to_keep``, ``shift_labels``), tied
heads, Gemma's soft-capping, Mixtral's router loss, and what the patch leaves alone (``remove``,
copies, pickling, ``state_dict``, ``generate``). The Trainer and the planner: test_patch_lm_loss_train.py."""

from __future__ import annotations

import copy
import inspect
import pickle
import types

import pytest
import torch
import torch.nn as nn
from support.lm_loss import FAMILIES, VOCAB, assert_same_grads, batch, build, run, transformers_or_skip

import llmmem
from llmmem.head import unpatch_lm_loss
from llmmem.head.marker import FusedHead, fused_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_equals_unpatched(family):
    model = build(family)
    ids, labels = batch()
    want, want_grads = run(model, input_ids=ids, labels=labels)
    logits = model(input_ids=ids).logits
    handle = llmmem.patch_lm_loss(model)
    got, got_grads = run(model, input_ids=ids, labels=labels)
    assert got.logits is None and "logits" not in got.keys()
    assert type(got) is type(want)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    assert got.loss.dtype == torch.float32
    assert_same_grads(got_grads, want_grads)
    with torch.no_grad():  # without labels: the model's own logits
        assert torch.equal(model(input_ids=ids).logits, logits)
    handle.remove()
    assert "forward" not in model.__dict__ and fused_head(model) is None
    torch.testing.assert_close(model(input_ids=ids, labels=labels).logits, logits, rtol=0, atol=0)


def test_the_mark_says_what_the_loss_is():
    model = build("llama")
    handle = llmmem.patch_lm_loss(model, chunk_size=7)
    assert fused_head(model) == FusedHead(vocab=VOCAB, hidden=32, softcap=None, tied=False, chunk_size=7)
    handle.remove()
    gpt2 = build("gpt2")
    with llmmem.patch_lm_loss(gpt2):
        assert fused_head(gpt2) == FusedHead(vocab=VOCAB, hidden=32, tied=True)
    assert fused_head(gpt2) is None
    gemma2 = build("gemma2")
    with llmmem.patch_lm_loss(gemma2):
        assert fused_head(gemma2).softcap == 2.0 and fused_head(gemma2).tied


def test_gpt2_tied_head_trains_the_input_embedding():
    model = build("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, labels = batch()
    _, want = run(model, input_ids=ids, labels=labels)
    with llmmem.patch_lm_loss(model):
        _, got = run(model, input_ids=ids, labels=labels)
    # the head's gradient reaches the one tied tensor: rows of tokens never in the input get it too
    unseen = sorted(set(range(VOCAB)) - set(ids.flatten().tolist()))
    assert got["transformer.wte.weight"][unseen].abs().sum() > 0
    assert_same_grads(got, want)


def test_gemma2_softcap_is_applied():
    model = build("gemma2")
    ids, labels = batch()
    want = model(input_ids=ids, labels=labels).loss
    uncapped = build("gemma2", final_logit_softcapping=None)(input_ids=ids, labels=labels).loss
    assert abs(want.item() - uncapped.item()) > 0.1  # the cap matters
    with llmmem.patch_lm_loss(model):
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, want, rtol=1e-5, atol=0)


def test_mixtral_router_loss_is_included():
    model = build("mixtral")
    ids, labels = batch()
    want = model(input_ids=ids, labels=labels)
    without = model(input_ids=ids, labels=labels, output_router_logits=False)
    assert want.aux_loss is not None and without.aux_loss is None
    with llmmem.patch_lm_loss(model):
        got = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=0, atol=0)
        assert got.router_logits is not None and got.logits is None
        torch.testing.assert_close(
            got.loss - model.router_aux_loss_coef * got.aux_loss, without.loss, rtol=1e-5, atol=1e-6
        )
        plain = model(input_ids=ids, labels=labels, output_router_logits=False)
        torch.testing.assert_close(plain.loss, without.loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("ignored", ["some", "all but one"])
def test_num_items_in_batch_divides_the_sum(ignored):
    model = build("llama")
    ids, labels = batch()
    if ignored == "all but one":
        labels[:] = -100
        labels[1, 5] = 17
    n = torch.tensor(23)  # the Trainer's count over every micro-batch of the step
    want, want_grads = run(model, input_ids=ids, labels=labels, num_items_in_batch=n)
    with llmmem.patch_lm_loss(model):
        got, got_grads = run(model, input_ids=ids, labels=labels, num_items_in_batch=n)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    assert_same_grads(got_grads, want_grads)


def test_every_label_ignored_gives_nan_as_hugging_face():
    model = build("llama")
    ids, labels = batch()
    labels[:] = -100
    assert torch.isnan(model(input_ids=ids, labels=labels).loss)
    with llmmem.patch_lm_loss(model):
        assert torch.isnan(model(input_ids=ids, labels=labels).loss)


@pytest.mark.parametrize("keep", [5, "positions"])
def test_logits_to_keep_is_respected(keep):
    model = build("qwen2")
    ids, labels = batch()
    if keep == "positions":
        keep = torch.tensor([0, 3, 4, 9])
        kept = labels[:, keep]
    else:
        kept = labels[:, -keep:]
    want, want_grads = run(model, input_ids=ids, labels=kept, logits_to_keep=keep)
    with llmmem.patch_lm_loss(model):
        got, got_grads = run(model, input_ids=ids, labels=kept, logits_to_keep=keep)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
        assert_same_grads(got_grads, want_grads)
        with pytest.raises(ValueError, match="logits_to_keep"):  # as the unpatched model, a mismatch is an error
            model(input_ids=ids, labels=labels, logits_to_keep=3)


def test_shift_labels_and_ignore_index_arguments():
    model = build("olmo2")
    ids, labels = batch()
    shifted = torch.randint(3, VOCAB, labels.shape)
    shifted[0, :2] = 7
    kwargs = dict(input_ids=ids, labels=labels, shift_labels=shifted, ignore_index=7)
    want, want_grads = run(model, **kwargs)
    with llmmem.patch_lm_loss(model):
        got, got_grads = run(model, **kwargs)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    assert_same_grads(got_grads, want_grads)


def test_tuple_outputs_and_positional_labels():
    model = build("gpt2")
    ids, labels = batch()
    want = model(input_ids=ids, labels=labels, return_dict=False)
    with llmmem.patch_lm_loss(model):
        got = model(input_ids=ids, labels=labels, return_dict=False)
        assert isinstance(got, tuple) and len(got) == len(want) - 1  # the logits are left out
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
        params = list(inspect.signature(model.forward).parameters)
        positional = [None] * params.index("labels") + [labels]
        positional[0] = ids
        torch.testing.assert_close(model(*positional).loss, want[0], rtol=1e-5, atol=0)
        assert model(*positional).logits is None


def test_llmmem_gpt_patched_equals_unpatched():
    from llmmem.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab_size=300, dropout=0.0))
    x = torch.randint(0, 300, (3, 16))
    y = torch.randint(0, 300, (3, 16))
    y[0, :5] = -100
    logits, want = model(x, y)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    handle = llmmem.patch_lm_loss(model)
    assert fused_head(model) == FusedHead(vocab=300, hidden=32, tied=True)
    none, got = model(x, y)
    assert none is None
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert_same_grads({n: p.grad for n, p in model.named_parameters()}, want_grads)
    assert torch.equal(model(x)[0], logits) and model(x)[1] is None
    assert model(x, targets=y)[0] is None
    handle.remove()
    assert "forward" not in model.__dict__


def test_unknown_architectures_are_refused_naming_the_class():
    transformers = transformers_or_skip()
    with pytest.raises(TypeError, match="TinyLM is not an architecture it knows.*LlamaForCausalLM"):
        llmmem.patch_lm_loss(type("TinyLM", (nn.Module,), {})())
    opt = transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=1,
            ffn_dim=32,
            num_attention_heads=2,
            word_embed_proj_dim=16,
        )
    )
    with pytest.raises(TypeError, match="OPTForCausalLM"):
        llmmem.patch_lm_loss(opt)
    assert "forward" not in opt.__dict__ and fused_head(opt) is None

    class MyLlama(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    mine = MyLlama(build("llama").config)
    with pytest.raises(TypeError, match="MyLlama overrides LlamaForCausalLM.forward"):
        llmmem.patch_lm_loss(mine)

    class Plain(transformers.LlamaForCausalLM):  # a subclass that keeps the forward is the same model
        pass

    with llmmem.patch_lm_loss(Plain(build("llama").config)):
        pass
    with pytest.raises(TypeError, match="must be an nn.Module"):
        llmmem.patch_lm_loss("llama")
    with pytest.raises(ValueError, match="chunk_size"):
        llmmem.patch_lm_loss(build("llama"), chunk_size=0)


def test_what_it_cannot_reproduce_is_refused():
    model = build("llama")
    model.loss_function = lambda *a, **k: torch.tensor(0.0)
    with pytest.raises(ValueError, match="another loss_function"):
        llmmem.patch_lm_loss(model)
    model = build("llama")
    handle = llmmem.patch_lm_loss(model)
    model.lm_head = nn.Sequential(nn.Linear(32, VOCAB))  # wrapped after the patch (an adapter, say)
    ids, labels = batch()
    with pytest.raises(TypeError, match=r"torch\.nn\.modules\.container\.Sequential, not a plain torch\.nn\.Linear"):
        model(input_ids=ids, labels=labels)
    handle.remove()


def test_a_head_under_accelerate_hooks_is_refused_at_patch_time():
    # cpu_offload leaves the head's weight on the meta device until its hooked forward runs
    accelerate = pytest.importorskip("accelerate")
    model = build("llama")
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    with pytest.raises(TypeError, match="lm_head's forward is replaced by accelerate's AlignDevicesHook"):
        llmmem.patch_lm_loss(model)
    assert fused_head(model) is None
    model = build("llama")
    model.lm_head.forward = lambda x: x  # any instance-level wrapper of the head
    with pytest.raises(TypeError, match="replaced by an instance attribute"):
        llmmem.patch_lm_loss(model)


def test_patching_twice_is_refused_and_remove_is_idempotent():
    model = build("llama")
    handle = llmmem.patch_lm_loss(model)
    with pytest.raises(ValueError, match="patched already"):
        llmmem.patch_lm_loss(model)
    handle.remove()
    handle.remove()
    assert "forward" not in model.__dict__ and fused_head(model) is None
    with pytest.raises(ValueError, match="not patched"):
        unpatch_lm_loss(model)
    handle = llmmem.patch_lm_loss(model)  # again, after removal
    assert "active" in repr(handle)
    handle.remove()
    assert "removed" in repr(handle)


def test_remove_restores_an_earlier_instance_forward_and_refuses_a_later_one():
    model = build("llama")
    calls = []

    def earlier(*args, **kwargs):
        calls.append(1)
        return type(model).forward(model, *args, **kwargs)

    model.forward = earlier
    ids, labels = batch()
    handle = llmmem.patch_lm_loss(model)
    assert model(input_ids=ids, labels=labels).logits is None and calls == [1]  # the patch runs it
    handle.remove()
    assert model.__dict__["forward"] is earlier

    handle = llmmem.patch_lm_loss(model)
    patched = model.forward
    model.forward = lambda *a, **k: patched(*a, **k)  # someone wraps the patched forward
    with pytest.raises(ValueError, match="replaced after patch_lm_loss"):
        handle.remove()
    model.forward = patched
    handle.remove()
    assert model.__dict__["forward"] is earlier


def test_rebound_as_a_method_it_still_works_and_removes():
    # accelerate's unwrap_model(keep_fp32_wrapper=False) rebinds the forward it wrapped with MethodType
    model = build("llama")
    ids, labels = batch()
    want = model(input_ids=ids, labels=labels).loss
    handle = llmmem.patch_lm_loss(model)
    model.forward = types.MethodType(model.forward, model)
    out = model(ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="patched already"):
        llmmem.patch_lm_loss(model)
    handle.remove()
    assert "forward" not in model.__dict__ and fused_head(model) is None


def test_copies_and_pickles_stay_patched_and_state_dict_is_unchanged(tmp_path):
    model = build("gpt2")
    keys = list(model.state_dict())
    ids, labels = batch()
    want = model(input_ids=ids, labels=labels).loss
    handle = llmmem.patch_lm_loss(model)
    assert list(model.state_dict()) == keys
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other.forward.model is other  # the copy's forward runs the copy, not the original
        assert fused_head(other) == fused_head(model)
        out = other(input_ids=ids, labels=labels)
        assert out.logits is None
        torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=0)
        unpatch_lm_loss(other)
        assert other(input_ids=ids, labels=labels).logits is not None
    assert model(input_ids=ids, labels=labels).logits is None  # the original is still patched
    model.save_pretrained(tmp_path)
    transformers = transformers_or_skip()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(input_ids=ids, labels=labels).loss, want, rtol=1e-6, atol=0)
    handle.remove()


def test_generate_is_unchanged():
    model = build("llama")
    ids, _ = batch()
    want = model.generate(ids[:, :6], max_new_tokens=4, do_sample=False, pad_token_id=0)
    with llmmem.patch_lm_loss(model):
        got = model.generate(ids[:, :6], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_under_bf16_autocast_the_loss_is_close_and_fp32():
    model = build("mistral")
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = run(model, input_ids=ids, labels=labels)
        with llmmem.patch_lm_loss(model):
            got, got_grads = run(model, input_ids=ids, labels=labels)
    assert got.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-2, atol=0)
    g, w = got_grads["lm_head.weight"], want_grads["lm_head.weight"]
    assert float((g - w).norm() / w.norm()) < 5e-2


def test_bf16_weights():
    model = build("llama").to(torch.bfloat16)
    ids, labels = batch()
    want = model(input_ids=ids, labels=labels).loss
    with llmmem.patch_lm_loss(model):
        got = model(input_ids=ids, labels=labels).loss
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)


def test_fp16_under_a_loss_scale_of_2_16_stays_finite():
    # a loss scaler's first scale is 2**16, inf in fp16: the loss and its upstream gradient are fp32
    model = build("llama").half()
    ids, labels = batch()
    scale = 2.0**16

    def unscaled_grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        (loss * scale).backward()
        return loss, {n: p.grad.float() / scale for n, p in model.named_parameters()}

    want_loss, want = unscaled_grads()
    with llmmem.patch_lm_loss(model):
        got_loss, got = unscaled_grads()
    assert got_loss.dtype == want_loss.dtype == torch.float32
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-2, atol=0)
    for name, g in got.items():
        assert torch.isfinite(g).all(), name
        assert float((g - want[name]).norm()) <= 2e-2 * float(want[name].norm()) + 1e-6, name
