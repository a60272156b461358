"""llmmem.parallel.parallelize on tiny Hugging Face models (random weights, gloo ranks on the CPU):
the split model computes the unsplit model's loss, each rank's gradients are the matching slices of
the unsplit gradients, and optimizer steps keep the two together.

Every rank builds the unsplit model with the same seed and keeps a copy as the reference, so the
comparisons are local. A process start with torch and transformers costs seconds, so each test
runs several checks in one set of ranks.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (optional)")

pytestmark = pytest.mark.distributed

VOCAB, SEQ = 128, 16


def _llama(kv_heads=4, heads=4, cls="LlamaForCausalLM", cfg_cls="LlamaConfig", hidden=64, layers=2, **extra):
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=64,
        **extra,
    )
    return getattr(transformers, cls)(cfg).train()


def _gpt2(vocab=VOCAB, **extra):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )
    return transformers.GPT2LMHeadModel(cfg).train()


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored tokens count too
    return {"input_ids": ids, "labels": labels}


def _expected_grad(ref, name, grad, tp_param, world, rank):
    """The slice of the unsplit gradient ``grad`` of parameter ``name`` that this rank holds."""
    from llmmem.parallel.gpt import _qkv_master_by_rank

    owner = ref.get_submodule(name.rpartition(".")[0])
    if type(owner).__name__ == "Conv1D" and name.endswith(".weight"):
        grad = grad.t()  # Conv1D keeps (in, out); the parallel layers (out, in)
    if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
        grad = _qkv_master_by_rank(grad, ref.config.num_attention_heads, world)
    if tuple(grad.shape) == tuple(tp_param.shape):
        return grad
    return grad.chunk(world, dim=tp_param.tensor_parallel_dim)[rank]


def _close(what, got, want, rtol, atol=0.0):
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
        diff = (got - want).abs().max().item() if got.shape == want.shape else "shapes differ"
        raise AssertionError(f"{what}: {tuple(got.shape)} vs {tuple(want.shape)}, max abs diff {diff}")


def _check_grads(ref, model, world, rank, sp_group=None):
    from llmmem.parallel import allreduce_sequence_parallel_grads

    if sp_group is not None:
        assert allreduce_sequence_parallel_grads(model, sp_group) > 0
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        want = _expected_grad(ref, name, ref_params[name].grad, p, world, rank)
        _close(f"grad of {name}", p.grad, want, rtol=1e-5, atol=1e-5)
        worst = max(worst, (p.grad - want).abs().max().item())
    return worst


def _check_params_per_rank(ref, model, world):
    """The split parameters hold 1/world of the elements of their unsplit counterparts."""
    ref_params = dict(ref.named_parameters())
    split = [(n, p) for n, p in model.named_parameters() if p.shape != ref_params[n].shape]
    here = sum(p.numel() for _, p in split)
    whole = sum(ref_params[n].numel() for n, _ in split)
    assert split and here * world == whole, (here, world, whole)
    replicated = sum(p.numel() for n, p in model.named_parameters() if p.shape == ref_params[n].shape)
    total_ref = sum(p.numel() for p in ref.parameters())
    assert here + replicated == total_ref - whole + here
    return here, whole, replicated, total_ref


def _layers_path(model):
    return "transformer.h" if hasattr(model, "transformer") else "model.layers"


def _matches_unsplit(make, world, rank, group, *, sequence_parallel=False, vocab_parallel=True, steps=3, report=None):
    """Loss, gradients and a few AdamW steps of parallelize(make()) against make()."""
    from llmmem.parallel import parallelize

    ref = make()
    model = parallelize(copy.deepcopy(ref), group, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    assert model.config.num_attention_heads == ref.config.num_attention_heads  # the config stays whole
    counts = _check_params_per_rank(ref, model, world)
    batch = _batch()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if sequence_parallel:  # between the layers each rank holds its slice of the sequence
        shapes = []
        handle = model.get_submodule(_layers_path(model))[0].register_forward_hook(
            lambda m, a, out: shapes.append(tuple(out.shape))
        )
        with torch.no_grad():
            model(**batch)
        handle.remove()
        assert shapes == [(2, SEQ // world, 64)], shapes
    diffs = []
    for step in range(steps):
        loss_ref = ref(**batch).loss
        loss_ref.backward()
        loss = model(**batch).loss
        loss.backward()
        rel = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
        assert rel <= (1e-6 if step == 0 else 1e-5), (step, loss.item(), loss_ref.item())
        grad_diff = _check_grads(ref, model, world, rank, group if sequence_parallel else None)
        diffs.append((rel, grad_diff))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    if report is not None:
        report.append((make.__name__ if hasattr(make, "__name__") else str(make), counts, diffs))
    return ref, model


def _logits_and_config(world, rank, group):
    """Without labels the logits are whole; with labels they are this rank's vocabulary slice. The
    attention reads no head count from the (whole) config: handed wrong counts, it computes the same."""
    from llmmem.parallel import parallelize

    ref = _llama(kv_heads=2)
    model = parallelize(copy.deepcopy(ref), group)
    batch = _batch()
    with torch.no_grad():
        full_ref = ref(input_ids=batch["input_ids"]).logits
        full = model(input_ids=batch["input_ids"]).logits
        _close("gathered logits", full, full_ref, rtol=1e-5, atol=1e-5)
        out = model(**batch)
        per = VOCAB // world
        _close("logits slice", out.logits, full_ref[..., rank * per : (rank + 1) * per], rtol=1e-5, atol=1e-5)
        # labels given positionally (input_ids, attention_mask, position_ids, cache, inputs_embeds, labels)
        out_pos = model(batch["input_ids"], None, None, None, None, batch["labels"])
        assert out_pos.logits.shape[-1] == per and torch.equal(out_pos.loss, out.loss)
        # HF Trainer's num_items_in_batch: sum / count, as transformers' loss
        n = torch.tensor(25)
        _close(
            "num_items_in_batch",
            model(**batch, num_items_in_batch=n).loss,
            ref(**batch, num_items_in_batch=n).loss,
            rtol=1e-6,
        )
        prompt = batch["input_ids"][:, :4]
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))  # a cache of local heads
        loss = out.loss
        for layer in model.model.layers:
            wrong = copy.copy(layer.self_attn.config)
            wrong.num_attention_heads = wrong.num_key_value_heads = 1
            layer.self_attn.config = wrong
        assert torch.equal(model(**batch).loss, loss)
    assert model.config.num_key_value_heads == 2


def _tied_stays_tied(world, rank, group):
    from llmmem.parallel import parallelize

    model = parallelize(_gpt2(), group)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.shape == (VOCAB // world, 64)
    untied = parallelize(_llama(tie_word_embeddings=False), group)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def _main_world(rank, world):
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    group = dist.group.WORLD
    report = []

    def llama():
        return _llama()

    def llama_gqa():
        return _llama(heads=8, kv_heads=4)

    def gpt2():
        return _gpt2()

    for make in (llama, llama_gqa, gpt2):
        _matches_unsplit(make, world, rank, group, report=report)
    if world == 2:
        _logits_and_config(world, rank, group)
        _tied_stays_tied(world, rank, group)
    if rank == 0:
        for name, (here, whole, replicated, total), diffs in report:
            print(
                f"{name} world {world}: split params {here} of {whole} per rank, replicated {replicated}, "
                f"unsplit total {total}; (loss rel diff, grad max abs diff) per step {diffs}"
            )


def _refusals(rank, world, group):
    from llmmem.parallel import parallelize

    with pytest.raises(
        ValueError, match=r"num_attention_heads \(3\) is not divisible by the tensor-parallel size \(2\)"
    ):
        parallelize(_llama(heads=3, kv_heads=3, hidden=48), group)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(1\) is not divisible .* \(2\)"):
        parallelize(_llama(heads=4, kv_heads=1), group)
    with pytest.raises(ValueError, match=r"intermediate size of transformer.h.0.mlp.c_fc \(129\) is not divisible"):
        parallelize(_gpt2(n_inner=129), group)
    odd_vocab = _gpt2(vocab=VOCAB + 1)
    with pytest.raises(ValueError, match=r"vocabulary size of transformer.wte \(129\) is not divisible .* \(2\)"):
        parallelize(odd_vocab, group)
    assert type(odd_vocab.transformer.h[0].attn.c_attn).__name__ == "Conv1D"  # a refusal leaves the model whole
    from llmmem.parallel import ColumnParallelLinear

    with pytest.raises(ValueError, match="disable_grad_reduce=True cannot be combined with sequence_parallel"):
        ColumnParallelLinear(8, 8, process_group=group, sequence_parallel=True, disable_grad_reduce=True)
    done = _llama()
    parallelize(done, group)
    with pytest.raises(ValueError, match="tensor-parallel already"):
        parallelize(done, group)


def _families_world(rank, world):
    """The other Llama-family classes, sequence parallelism, and the refusals that need a group."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    group = dist.group.WORLD
    report = []
    families = [
        ("MistralForCausalLM", "MistralConfig", {}),
        ("Qwen2ForCausalLM", "Qwen2Config", {}),  # q/k/v biases
        ("Qwen3ForCausalLM", "Qwen3Config", {}),  # q/k norms over head_dim
        ("GemmaForCausalLM", "GemmaConfig", {}),  # scaled embedding
        ("Gemma2ForCausalLM", "Gemma2Config", {"attn_implementation": "eager"}),  # soft-capping, 4 norms
    ]
    for cls, cfg_cls, extra in families:
        if not hasattr(transformers, cls):
            continue

        def make(cls=cls, cfg_cls=cfg_cls, extra=extra):
            attn = extra.get("attn_implementation")
            model = _llama(heads=8, kv_heads=2 * world, cls=cls, cfg_cls=cfg_cls)
            if attn:
                model.set_attn_implementation(attn)
            return model

        make.__name__ = cls
        _matches_unsplit(make, world, rank, group, steps=1, report=report)

    def llama_sp():
        return _llama(heads=8, kv_heads=4)

    def gpt2_sp():
        return _gpt2()

    for make in (llama_sp, gpt2_sp):
        _matches_unsplit(make, world, rank, group, sequence_parallel=True, steps=2, report=report)

    def gpt2_odd_vocab_whole():
        return _gpt2(vocab=VOCAB + 1)

    _matches_unsplit(gpt2_odd_vocab_whole, world, rank, group, vocab_parallel=False, steps=1, report=report)
    _refusals(rank, world, group)
    if rank == 0:
        for name, (here, whole, _, _), diffs in report:
            print(f"{name} world {world}: split params {here} of {whole}; {diffs}")


def _with_auto_checkpoint(rank, world):
    """parallelize, then auto_checkpoint(budget=0.5): the loss and gradients of the parallel model
    without a plan, with and without sequence parallelism (whose hooks at the stack's edges must
    not slice a layer the planner replays)."""
    import torch.distributed as dist

    import llmmem
    from llmmem.parallel import allreduce_sequence_parallel_grads, parallelize

    warnings.filterwarnings("ignore")
    group = dist.group.WORLD
    batch = _batch()
    for sp in (False, True):
        results = []
        for planned in (False, True):
            model = parallelize(
                _llama(heads=8, kv_heads=4, layers=4), group, sequence_parallel=sp
            )  # 2 cannot fit half
            if planned:
                plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=0)
                assert plan.regions or any(m != "store-all" for m in plan.modes), plan.modes
                for p in model.parameters():
                    p.grad = None
            loss = model(**batch).loss
            loss.backward()
            if sp:
                allreduce_sequence_parallel_grads(model, group)
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (loss_a, grads_a), (loss_b, grads_b) = results
        rel = abs(loss_a.item() - loss_b.item()) / abs(loss_a.item())
        assert rel <= 1e-6, (loss_a, loss_b)
        worst = max((grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a)
        assert worst <= 1e-6, worst
        if rank == 0:
            print(
                f"auto_checkpoint (sequence_parallel={sp}): {plan.modes}, regions {plan.regions}; loss bitwise "
                f"{torch.equal(loss_a, loss_b)}, rel {rel:.3g}, grad max diff {worst:.3g}"
            )


def _run(fn, world):
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, fn, world, timeout=150)
    print(results[0].output)


@pytest.mark.parametrize("world", [2, 4])
def test_llama_gqa_and_gpt2_match_the_unsplit_model(world):
    _run("_main_world", world)


def test_families_sequence_parallel_and_refusals():
    _run("_families_world", 2)


def test_composes_with_auto_checkpoint():
    _run("_with_auto_checkpoint", 2)


def test_refuses_an_unknown_model_class():
    from llmmem.parallel import parallelize

    with pytest.raises(TypeError, match="no tensor-parallel plan for OPTForCausalLM; supported: LlamaForCausalLM"):
        parallelize(
            transformers.OPTForCausalLM(
                transformers.OPTConfig(
                    vocab_size=64,
                    hidden_size=16,
                    num_hidden_layers=1,
                    ffn_dim=32,
                    num_attention_heads=2,
                    word_embed_proj_dim=16,
                )
            )
        )
    with pytest.raises(TypeError, match="no tensor-parallel plan for Linear"):
        parallelize(nn.Linear(2, 2))


def test_refuses_without_a_process_group():
    import torch.distributed as dist

    from llmmem.parallel import parallelize

    if dist.is_initialized():
        pytest.skip("this process has a process group")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        parallelize(_gpt2())
