"""The estimator's model state with llmmem.optim: moments in every format, fp32-kept small tensors,
master weights and the step in backward's gradients, against the bytes a real
``llmmem.optim.AdamW`` holds after a step on a Hugging Face Llama and on llmmem's GPT (random
weights, small configs); the settings' semantics and their bad values."""

from __future__ import annotations

import pytest
import torch

import llmmem
import llmmem.optim
from llmmem.estimation import model_configs
from llmmem.estimation.model_state import config_tensors, llmmem_state, moment_bytes
from llmmem.models.gpt import GPT, GPTConfig
from llmmem.optim import formats

FORMATS = ("fp32", "bf16", "int8", "int4")
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def _gpt():
    # odd sizes: int4 packs ceil(n / 2) bytes, and blocks do not divide the tensors
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=2, hidden=75, heads=5, seq_len=32, vocab_size=251, dropout=0.0))


def _llama():
    transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=250,
        hidden_size=96,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # k and v: 48 x 96 = 4608 elements, just above the 4096 threshold
        max_position_embeddings=64,
        attn_implementation="eager",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt": _gpt, "llama": _llama}


def _loss(model, ids):
    if isinstance(model, GPT):
        return model(ids, targets=ids)[1]
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _held(opt) -> tuple[int, int]:
    """(moment bytes, master bytes) the optimizer's state holds on the device (its ``step`` counters
    are host scalars)."""
    moments = master = 0
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if key in _MOMENT_KEYS:
                    moments += value.numel() * value.element_size()
                elif key == "master":
                    master += value.numel() * value.element_size()
    return moments, master


def _config_of(model):
    return model.cfg if isinstance(model, GPT) else model.config


def test_moment_bytes_are_llmmem_optims_layout():
    for dtype in FORMATS:
        for block in (32, 128, 256, 4096) if dtype in ("int8", "int4") else (0,):
            fmt = formats.Format(dtype, block)
            for n in (1, 2, 31, 127, 128, 129, 4095, 4096, 4097, 65_537):
                assert moment_bytes(dtype, n, block or None) == 2 * fmt.moment_bytes(n), (dtype, block, n)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_config_tensors_are_the_modules_tensors(kind):
    model = MODELS[kind]()
    cfg, _ = model_configs.resolve(model)
    assert sorted(config_tensors(cfg, seq=16)) == sorted(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("state_dtype", FORMATS)
@pytest.mark.parametrize("weights, master", [("bf16", False), ("bf16", True), ("fp32", False)])
def test_state_bytes_equal_a_real_llmmem_adamw_after_a_step(kind, state_dtype, weights, master):
    model = MODELS[kind]()
    if weights == "bf16":
        model.to(torch.bfloat16)
    opt = llmmem.optim.AdamW(model.parameters(), lr=1e-3, state_dtype=state_dtype, master_weights=master)
    ids = torch.randint(0, 250, (2, 16))
    _loss(model, ids).backward()
    opt.step()
    moments, held_master = _held(opt)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    kwargs = dict(
        batch=2,
        seq=16,
        precision=weights,
        optimizer=f"adamw-{state_dtype}",
        master_weights=master if weights == "bf16" else None,
        device_type="cpu",
    )
    for described in (model, _config_of(model)):  # the module's own tensors, and the config's
        est = llmmem.estimate(described, **kwargs)
        assert est.optimizer_state == moments, (described.__class__.__name__, est.optimizer_state, moments)
        assert est.master_weights == held_master
        assert (est.parameters, est.gradients) == (params, grads)
    if state_dtype in ("int8", "int4"):
        small = [p.numel() for p in model.parameters() if p.numel() < 4096]
        assert est.state_terms["kept_fp32_tensors"] == len(small) > 0


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_block_size_and_threshold_are_counted_as_set(kind):
    model = MODELS[kind]().to(torch.bfloat16)
    opt = llmmem.optim.AdamW(model.parameters(), state_dtype="int4", block_size=64, min_quantized_numel=5000)
    _loss(model, torch.randint(0, 250, (1, 8))).backward()
    opt.step()
    est = llmmem.estimate(
        model,
        batch=1,
        seq=8,
        precision="bf16",
        optimizer="adamw-int4",
        block_size=64,
        min_quantized_numel=5000,
        device_type="cpu",
    )
    assert est.optimizer_state == _held(opt)[0]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_step_in_backward_holds_the_largest_gradient_only(kind):
    model = MODELS[kind]().to(torch.bfloat16)
    opt = llmmem.optim.AdamW(model.parameters(), state_dtype="int8")
    live = {}
    peak = [0]

    def seen(p):  # runs before step_in_backward's own hook (registered first) frees p.grad
        live[id(p)] = p.grad.numel() * p.grad.element_size()
        peak[0] = max(peak[0], sum(b for i, b in live.items() if i in alive()))

    params = list(model.parameters())

    def alive():
        return {id(p) for p in params if p.grad is not None}

    hooks = [p.register_post_accumulate_grad_hook(seen) for p in params]
    handle = llmmem.optim.step_in_backward(model, opt)
    try:
        _loss(model, torch.randint(0, 250, (2, 16))).backward()
    finally:
        handle.remove()
        for h in hooks:
            h.remove()
    assert all(p.grad is None for p in params)
    est = llmmem.estimate(
        model, batch=2, seq=16, precision="bf16", optimizer="adamw-int8", step_in_backward=True, device_type="cpu"
    )
    assert est.gradients == peak[0] == max(p.numel() for p in params) * 2
    without = llmmem.estimate(model, batch=2, seq=16, precision="bf16", optimizer="adamw-int8", device_type="cpu")
    assert without.gradients == sum(p.numel() for p in params) * 2


def test_torch_optimizers_keep_their_bytes_and_llmmem_fp32_matches_them():
    n = llmmem.estimate("gpt2").parameter_count
    for name in ("adam", "adamw"):
        est = llmmem.estimate("gpt2", precision="bf16-mixed", optimizer=name)
        assert (est.optimizer_state, est.master_weights) == (8 * n, 4 * n)
    same = llmmem.estimate("gpt2", precision="bf16-mixed", optimizer="adamw-fp32")
    assert (same.optimizer_state, same.master_weights) == (8 * n, 4 * n)  # the precision's master
    lean = llmmem.estimate("gpt2", precision="bf16", optimizer="adamw-fp32")
    assert (lean.optimizer_state, lean.master_weights) == (8 * n, 0)
    kept = llmmem.estimate("gpt2", precision="bf16", optimizer="adamw-int8", master_weights=True)
    assert kept.master_weights == 4 * n
    dropped = llmmem.estimate("gpt2", precision="bf16-mixed", optimizer="adamw-int8", master_weights=False)
    assert (
        dropped.master_weights == 0
        and dropped.total == llmmem.estimate("gpt2", precision="bf16", optimizer="adamw-int8").total
    )


def test_int8_and_int4_bytes_per_parameter_on_llama_7b():
    cfg = model_configs.lookup("llama-7b")
    tensors = config_tensors(cfg, seq=2048)
    for dtype, bound in (("int8", 2.05), ("int4", 1.1), ("bf16", 4.0)):
        est = llmmem.estimate("llama-7b", precision="bf16", optimizer=f"adamw-{dtype}")
        assert est.optimizer_state == llmmem_state(dtype, tensors).bytes
        assert est.optimizer_state / est.parameter_count <= bound


def test_zero_and_tensor_parallel_divide_the_llmmem_state():
    base = llmmem.estimate("llama-13b", precision="bf16", optimizer="adamw-int8", data_parallel=8)
    z1 = llmmem.estimate("llama-13b", precision="bf16", optimizer="adamw-int8", data_parallel=8, zero_stage=1)
    assert z1.optimizer_state == -(-base.optimizer_state // 8)
    t2 = llmmem.estimate("llama-13b", precision="bf16", optimizer="adamw-int8", tensor_parallel=2)
    cfg = model_configs.lookup("llama-13b")
    assert t2.optimizer_state == llmmem_state("int8", config_tensors(cfg, 2048, 2)).bytes
    assert sum(config_tensors(cfg, 2048, 2)) == cfg.parameters(2048, 2) == t2.parameters_per_device


def test_recommendation_of_a_step_in_backward_request_is_valid_fed_back():
    est = llmmem.estimate(
        "llama-7b",
        precision="bf16",
        optimizer="adamw-int8",
        step_in_backward=True,
        checkpointing="all",
        device_memory="24GiB",
    )
    rec = est.recommendation
    assert not est.fits and rec is not None
    again = llmmem.estimate("llama-7b", **rec.settings, device_memory="24GiB")
    assert again.total == rec.estimate.total and again.fits
    if rec.settings["data_parallel"] > 1:  # DDP keeps every gradient: the step in backward is dropped
        assert rec.settings["step_in_backward"] is False


def test_model_state_fixes_rank_what_applies():
    est = llmmem.estimate("llama-7b", seq=2048, device_memory="24GiB")
    changes = [f.change for f in est.model_state_fixes]
    assert any("state_dtype='int8'" in c for c in changes)
    assert any(c.startswith("step_in_backward") for c in changes)
    assert any(c.startswith("bf16 weights") for c in changes)
    assert changes[-1].startswith("all of:")
    singles = est.model_state_fixes[:-1]
    assert [f.saves for f in singles] == sorted((f.saves for f in singles), reverse=True)
    int8 = next(f for f in singles if "'int8'" in f.change)
    switched = llmmem.estimate("llama-7b", seq=2048, optimizer="adam-int8")
    assert int8.saves == est.total - switched.total == est.optimizer_state - switched.optimizer_state
    sib = next(f for f in singles if f.change.startswith("step_in_backward"))
    assert sib.saves == est.gradients - 2 * 32000 * 4096
    assert "changes of the model state" in str(est) and "all of:" in str(est)
    # already lean: no int8 (nor int4 over int4), no step in backward, no master to drop
    lean = llmmem.estimate(
        "llama-7b", precision="bf16", optimizer="adamw-int4", step_in_backward=True, device_memory="1GiB"
    )
    assert lean.model_state_fixes == []
    # SGD: llmmem has no quantized SGD nor a stochastic-rounding one; the step in backward applies
    sgd = llmmem.estimate("llama-7b", optimizer="sgd-momentum", device_memory="24GiB")
    assert [f.change.split(" ")[0] for f in sgd.model_state_fixes] == ["step_in_backward"]
    # a request that fits gets none
    assert llmmem.estimate("gpt2", device_memory="80GB").model_state_fixes == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"optimizer": "adamw-int2"}, r"optimizer: unknown value 'adamw-int2'"),
        ({"master_weights": "yes", "optimizer": "adamw-int8"}, r"master_weights: must be None, True or False"),
        ({"master_weights": False}, r"master_weights: False contradicts precision 'bf16-mixed'"),
        ({"master_weights": True, "precision": "bf16", "optimizer": "adamw"}, r"master_weights: True contradicts"),
        ({"master_weights": True, "precision": "fp32", "optimizer": "adamw-int8"}, r"master_weights: fp32"),
        ({"master_weights": False, "precision": "fp16-mixed", "optimizer": "adamw-int8"}, r"master_weights: .*fp16"),
        ({"step_in_backward": "yes"}, r"step_in_backward: must be True or False"),
        ({"step_in_backward": True, "data_parallel": 2}, r"step_in_backward: .*one data-parallel rank"),
        ({"optimizer": "adamw-int8", "block_size": 100}, r"block_size: must be a power of two in \[32, 4096\]"),
        ({"optimizer": "adamw-int8", "block_size": 8192}, r"block_size: must be a power of two"),
        ({"optimizer": "adamw-int8", "block_size": True}, r"block_size: must be an integer"),
        ({"optimizer": "adamw", "block_size": 256}, r"block_size: applies to the quantized llmmem optimizers"),
        ({"optimizer": "adamw-bf16", "min_quantized_numel": 10}, r"min_quantized_numel: applies to the quantized"),
        ({"optimizer": "adamw-int4", "min_quantized_numel": -1}, r"min_quantized_numel: must be an integer >= 0"),
    ],
)
def test_bad_model_state_arguments_raise_value_error_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llmmem.estimate("gpt2", **kwargs)
