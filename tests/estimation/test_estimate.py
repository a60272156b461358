"""The memory estimator: published figures, ZeRO/TP arithmetic, Megatron's formula, agreement with
what autograd really saves, monotonicity, the fit recommendation, bad input and the CLI."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

import llmmem
from llmmem.__main__ import main
from llmmem.estimation.estimator import estimate, megatron_layer_activation_bytes
from llmmem.estimation.model_configs import NAMED_MODELS, ModelConfig

GB = 10**9


# ---------------------------------------------------------------------------------------------
# parameters and model state
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, expected, rel",
    [
        ("llama-7b", 6.74e9, 0.005),  # Touvron et al. 2023 (6,738,415,616 in the HF checkpoint)
        ("llama-13b", 13.0e9, 0.005),
        ("llama-70b", 69.0e9, 0.005),  # Llama 2 70B, grouped-query attention
        ("gpt2", 124_439_808, 0),  # Hugging Face num_parameters()
        ("gpt2-medium", 354_823_168, 0),
        ("gpt2-large", 774_030_080, 0),
        ("gpt2-xl", 1_557_611_200, 0),
    ],
)
def test_named_parameter_counts(name, expected, rel):
    est = estimate(name, seq=1024)
    assert est.parameter_count == pytest.approx(expected, rel=rel)


@pytest.mark.parametrize("name, gigabytes", [("llama-7b", 14), ("llama-13b", 26), ("llama-70b", 140)])
def test_16bit_weights_match_published_sizes(name, gigabytes):
    est = estimate(name, precision="fp16-mixed")
    assert est.parameters / GB == pytest.approx(gigabytes, rel=0.04)


def test_names_are_case_insensitive():
    assert estimate("LLaMA-7B").total == estimate("llama-7b").total


def test_bytes_per_parameter():
    n = estimate("gpt2").parameter_count
    fp32_adam = estimate("gpt2", precision="fp32", optimizer="adam")
    assert fp32_adam.optimizer_state == 8 * n  # Adam's two fp32 moments
    assert (fp32_adam.parameters, fp32_adam.gradients, fp32_adam.master_weights) == (4 * n, 4 * n, 0)
    for precision in ("bf16-mixed", "fp16-mixed"):
        mixed = estimate("gpt2", precision=precision, optimizer="adamw")
        state = mixed.parameters + mixed.gradients + mixed.master_weights + mixed.optimizer_state
        assert state == 16 * n  # ZeRO paper: 2 + 2 + 12 bytes per parameter
    assert estimate("gpt2", precision="fp32", optimizer="sgd").optimizer_state == 0
    assert estimate("gpt2", precision="fp32", optimizer="sgd-momentum").optimizer_state == 4 * n
    pure = estimate("gpt2", precision="bf16", optimizer="adam")
    assert (pure.parameters, pure.gradients, pure.master_weights, pure.optimizer_state) == (2 * n, 2 * n, 0, 4 * n)


def test_zero_stages_divide_by_data_parallel_size():
    base = estimate("llama-13b", data_parallel=8, zero_stage=0)
    z = [estimate("llama-13b", data_parallel=8, zero_stage=s) for s in range(4)]
    up = lambda x: -(-x // 8)  # noqa: E731 - ceil division, a rank holds whole bytes
    assert z[1].optimizer_state == up(base.optimizer_state) and z[1].master_weights == up(base.master_weights)
    assert z[1].gradients == base.gradients and z[1].parameters == base.parameters
    assert z[2].gradients == up(base.gradients) and z[2].parameters == base.parameters
    assert z[3].parameters == up(base.parameters)
    assert [e.activations for e in z] == [base.activations] * 4  # ZeRO does not touch activations
    assert z[0].total > z[1].total > z[2].total > z[3].total
    # without data parallelism there is nothing to partition over
    assert estimate("llama-13b", zero_stage=3).parameters == estimate("llama-13b").parameters


def test_tensor_parallel_divides_weights():
    one = estimate("llama-70b")
    n = one.parameter_count
    norms = (2 * 80 + 1) * 8192  # RMSNorm weights are replicated; everything else is split
    for t in (2, 4, 8):
        est = estimate("llama-70b", tensor_parallel=t)
        assert est.parameters_per_device == (n - norms) // t + norms
        assert est.parameters == 2 * est.parameters_per_device
        assert est.optimizer_state == pytest.approx(one.optimizer_state / t, rel=2e-4)


# ---------------------------------------------------------------------------------------------
# activations: Megatron's formula as the 16-bit special case
# ---------------------------------------------------------------------------------------------
# Megatron's assumptions: GELU MLP of width 4h, multi-head attention, dropout, explicit attention.
MEGATRON_MODEL = {"layers": 4, "hidden": 1024, "heads": 16, "vocab": 51200, "dropout": 0.1}


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("seq, batch", [(2048, 1), (512, 4)])
def test_layer_activations_reduce_to_megatron_formula(t, sp, seq, batch):
    kw = dict(batch=batch, seq=seq, precision="bf16-mixed", tensor_parallel=t, sequence_parallel=sp)
    est = estimate(MEGATRON_MODEL, **kw)
    stats = est.layer_terms["norm statistics (fp32)"]  # fp32 mean/rstd: real, but not in the paper
    s, b, h, a = seq, batch, 1024, 16
    assert est.activations_per_layer - stats == megatron_layer_activation_bytes(
        s, b, h, a, tensor_parallel=t, sequence_parallel=sp
    )
    # the closed forms of Korthikanti et al. 2022, table 2
    if not sp:
        assert (
            megatron_layer_activation_bytes(s, b, h, a, tensor_parallel=t)
            == s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t
        )
    else:
        assert (
            megatron_layer_activation_bytes(s, b, h, a, tensor_parallel=t, sequence_parallel=True)
            == s * b * h * (34 + 5 * a * s / h) / t
        )

    sel = estimate(MEGATRON_MODEL, checkpointing="selective", **kw)
    assert sel.activations_layers / 4 - stats == megatron_layer_activation_bytes(
        s, b, h, a, tensor_parallel=t, sequence_parallel=sp, recompute="selective"
    )
    if sp:
        assert sel.activations_layers / 4 - stats == 34 * s * b * h / t
    full = estimate(MEGATRON_MODEL, checkpointing="full", **kw)
    assert full.activations_layers == 4 * megatron_layer_activation_bytes(
        s, b, h, a, tensor_parallel=t, sequence_parallel=sp, recompute="full"
    )


def test_fp32_and_cpu_change_element_sizes():
    cuda16 = estimate(MEGATRON_MODEL, precision="bf16-mixed").layer_terms
    cpu32 = estimate(MEGATRON_MODEL, precision="fp32", device_type="cpu").layer_terms
    assert cpu32["q, k, v"] == 2 * cuda16["q, k, v"]  # 4-byte instead of 2-byte elements
    assert cuda16["attention dropout mask"] * 2 == cuda16["attention probabilities (softmax output)"]  # bool
    assert cpu32["attention dropout mask"] == cpu32["attention probabilities (softmax output)"]  # noise tensor


def test_fused_attention_keeps_no_scores():
    explicit = estimate("llama-7b", attention="explicit")
    fused = estimate("llama-7b", attention="sdpa")
    s, b, a = 2048, 1, 32
    assert explicit.layer_terms["attention probabilities (softmax output)"] == 2 * a * s * s * b
    assert not any("probabilities" in k for k in fused.layer_terms)
    # LLaMA has no dropout: the softmax output is the only s x s tensor; the kernel keeps an fp32 log-sum-exp
    assert fused.activations_per_layer == explicit.activations_per_layer - 2 * a * s * s * b + 4 * a * s * b


# ---------------------------------------------------------------------------------------------
# activations: agreement with what autograd saves for backward (small GPT, CPU, fp32)
# ---------------------------------------------------------------------------------------------
def _saved_bytes(model, batch: int, seq: int) -> int:
    """Bytes of the distinct storages autograd saves during the forward pass, parameters excluded."""
    import torch

    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved.setdefault(storage.data_ptr(), storage.nbytes())  # each storage once
        return t

    idx = torch.randint(0, model.cfg.vocab_size, (batch, seq))
    targets = torch.randint(0, model.cfg.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, targets)
    loss.backward()  # the graph is usable: nothing above broke it
    return sum(saved.values())


# (layers, hidden, heads, seq, batch, vocab, dropout, attention)
MEASURED_CONFIGS = [
    (2, 64, 4, 32, 2, 100, 0.1, "explicit"),
    (3, 96, 6, 64, 3, 257, 0.1, "explicit"),
    (1, 32, 1, 16, 4, 64, 0.2, "explicit"),
    (2, 128, 2, 128, 1, 512, 0.0, "explicit"),
    (2, 64, 4, 48, 2, 100, 0.0, "sdpa"),
    (2, 64, 4, 48, 2, 100, 0.1, "sdpa"),
]


@pytest.mark.parametrize("layers, hidden, heads, seq, batch, vocab, dropout, attention", MEASURED_CONFIGS)
def test_activations_match_autograd_saved_tensors(layers, hidden, heads, seq, batch, vocab, dropout, attention):
    pytest.importorskip("torch")
    from llmmem.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(
        layers=layers, hidden=hidden, heads=heads, seq_len=seq, vocab_size=vocab, dropout=dropout, attention=attention
    )
    model = GPT(cfg).train()
    measured = _saved_bytes(model, batch, seq)
    est = estimate(model, batch=batch, seq=seq, precision="fp32", device_type="cpu")
    print(f"{cfg}: estimated {est.activations} B, measured {measured} B, {est.activations / measured - 1:+.2%}")
    assert abs(est.activations - measured) <= 0.15 * measured
    # the module path counts the real parameters; the formula agrees with the count
    assert est.parameter_count == model.num_parameters()
    dims = dict(
        layers=layers, hidden=hidden, heads=heads, vocab=vocab, max_positions=seq, dropout=dropout, attention=attention
    )
    assert estimate(dims, batch=batch, seq=seq, precision="fp32", device_type="cpu").total == est.total
    assert estimate(cfg, batch=batch, seq=seq, precision="fp32", device_type="cpu").total == est.total  # dataclass


# ---------------------------------------------------------------------------------------------
# monotonicity
# ---------------------------------------------------------------------------------------------
def test_more_checkpointing_keeps_fewer_activation_bytes():
    acts = {
        c: estimate("llama-13b", checkpointing=c).activations
        for c in ("none", "every-8", "every-4", 2, "full", "selective")
    }
    assert acts["none"] > acts["every-8"] > acts["every-4"] > acts[2] > acts["full"]
    assert acts["none"] > acts["selective"] > acts["full"]
    assert estimate("llama-13b", checkpointing=1).activations == acts["full"]
    slow = {c: estimate("llama-13b", checkpointing=c).slowdown for c in ("none", "selective", "every-4", "full")}
    assert slow["none"] == 0 < slow["selective"] < slow["every-4"] < slow["full"]
    assert slow["full"] == pytest.approx(1 / 3, abs=0.03)  # one extra forward of the layers


def test_larger_tensor_parallel_keeps_fewer_bytes_per_device():
    for sp in (False, True):
        totals = [estimate("llama-70b", tensor_parallel=t, sequence_parallel=sp) for t in (1, 2, 4, 8)]
        for a, b in zip(totals, totals[1:]):
            assert b.total < a.total and b.activations < a.activations and b.parameters < a.parameters
    plain = estimate("llama-70b", tensor_parallel=8)
    assert estimate("llama-70b", tensor_parallel=8, sequence_parallel=True).activations < plain.activations


def test_longer_sequences_and_batches_cost_more():
    assert estimate("gpt2", seq=1024).activations < estimate("gpt2", seq=2048).activations
    assert estimate("gpt2", batch=2).activations == pytest.approx(2 * estimate("gpt2", batch=1).activations, rel=1e-3)


# ---------------------------------------------------------------------------------------------
# fitting into device memory
# ---------------------------------------------------------------------------------------------
def _check_recommendation(est, budget):
    rec = est.recommendation
    assert rec is not None and rec.estimate.fits and rec.estimate.total <= budget
    # the recommended settings, fed back in, give the same numbers (no hidden state)
    again = estimate(est.model, **rec.settings, device_memory=budget)
    assert again.total == rec.estimate.total and again.fits
    assert rec.devices == rec.settings["data_parallel"] * rec.settings["tensor_parallel"]
    assert rec.changes and all(rec.settings[k] == v for k, v in rec.changes.items())


def test_llama_7b_does_not_fit_80gb_and_gets_a_recommendation_that_does():
    est = estimate("llama-7b", batch=1, seq=2048, device_memory="80GB")
    assert est.device_memory == 80 * GB and not est.fits
    _check_recommendation(est, 80 * GB)
    # 16 bytes/param of model state (108 GB) cannot fit on one 80 GB device whatever we recompute
    assert est.recommendation.devices > 1
    assert "recommendation" in est.advice and "recommendation" in str(est)


def test_recommendation_on_the_same_devices_prefers_cheap_techniques():
    est = estimate("llama-13b", batch=4, seq=4096, data_parallel=8, device_memory="80GB")
    assert not est.fits
    _check_recommendation(est, 80 * GB)
    rec = est.recommendation
    assert rec.devices == 8
    # the cheapest fitting choice is at most as slow as full recompute on top of what else it uses
    worst = estimate(est.model, **{**rec.settings, "checkpointing": "full"})
    assert rec.slowdown <= worst.slowdown


def test_fitting_config_with_needless_recompute_is_told_so():
    est = estimate("gpt2", checkpointing="full", device_memory="80GB")
    assert est.fits
    assert est.recommendation is not None and est.recommendation.changes == {"checkpointing": "none"}
    assert est.recommendation.slowdown < est.slowdown
    assert estimate("gpt2", device_memory="80GB").recommendation is None


def test_impossible_config_says_so():
    est = estimate("llama-70b", seq=4096, device_memory="100MB")
    assert not est.fits and est.recommendation is None
    assert "impossible" in est.advice and "impossible" in str(est)
    assert est.to_dict()["recommendation"] is None


def test_to_dict_is_json_ready_and_consistent():
    d = estimate("llama-7b", device_memory="80GiB").to_dict()
    json.dumps(d)
    b = d["bytes"]
    assert b["total"] == sum(
        b[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state", "activations", "temporary")
    )
    assert b["activations_per_layer"] == sum(d["layer_terms"].values())
    assert b["activations_other"] == sum(d["other_terms"].values())
    assert b["temporary"] == sum(d["temporary_terms"].values())
    assert d["device_memory"] == 80 * 2**30 and d["fits"] is False


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model, kwargs, match",
    [
        ("llama-8x", {}, r"model: unknown model name .*gpt2-xl, llama-7b, llama-13b, llama-70b"),
        (42, {}, r"model: expected"),
        ({"layers": 2, "hidden": 64, "heads": 4}, {}, r"missing dimension\(s\) vocab"),
        ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "hiden": 3}, {}, r"unknown dimension 'hiden'"),
        ({"layers": 0, "hidden": 64, "heads": 4, "vocab": 10}, {}, r"layers: must be a positive integer"),
        ({"layers": 2, "hidden": -64, "heads": 4, "vocab": 10}, {}, r"hidden: must be a positive integer"),
        ({"layers": 2, "hidden": 64, "heads": 5, "vocab": 10}, {}, r"heads: 5 heads do not divide hidden size 64"),
        ({"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 3, "vocab": 10}, {}, r"kv_heads"),
        ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "mlp": "relu"}, {}, r"mlp: unknown value"),
        ("gpt2", {"batch": 0}, r"batch: must be a positive integer"),
        ("gpt2", {"seq": -1}, r"seq: must be a positive integer"),
        ("gpt2", {"batch": True}, r"batch: must be a positive integer"),
        ("gpt2", {"data_parallel": 0}, r"data_parallel"),
        ("gpt2", {"tensor_parallel": 5}, r"tensor_parallel: size 5 does not divide heads \(12\)"),
        ("llama-70b", {"tensor_parallel": 16}, r"tensor_parallel: size 16 does not divide kv_heads \(8\)"),
        ("gpt2", {"device_memory": "80 gigs"}, r"device_memory: cannot parse"),
        ("gpt2", {"device_memory": 0}, r"device_memory: must be more than 0"),
        ("gpt2", {"precision": "fp8"}, r"precision: unknown value 'fp8'.*bf16-mixed"),
        ("gpt2", {"optimizer": "lion"}, r"optimizer: unknown value 'lion'"),
        ("gpt2", {"checkpointing": "sometimes"}, r"checkpointing: unknown value"),
        ("gpt2", {"checkpointing": 0}, r"checkpointing: must be a positive integer"),
        ("gpt2", {"checkpointing": "every-0"}, r"checkpointing: must be a positive integer"),
        ("gpt2", {"zero_stage": 4}, r"zero_stage: must be 0, 1, 2 or 3"),
        ("gpt2", {"zero_stage": -1}, r"zero_stage"),
        ("gpt2", {"attention": "linear"}, r"attention: unknown value"),
        ("gpt2", {"device_type": "tpu"}, r"device_type: unknown value"),
        ("gpt2", {"sequence_parallel": "yes"}, r"sequence_parallel"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate(model, **kwargs)


def test_module_without_dimensions_is_rejected():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"model: this Linear has no \.cfg or \.config"):
        estimate(torch.nn.Linear(4, 4))


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def test_cli_table_and_recommendation(capsys):
    assert main(["estimate", "llama-7b", "--batch", "1", "--seq", "2048", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    for word in (
        "6.74 B parameters",
        "optimizer state",
        "activations",
        "largest temporary",
        "total",
        "does NOT fit",
        "recommendation",
    ):
        assert word in out
    assert f"{estimate('llama-7b').total:,}" in out


def _byte_column(text: str) -> dict:
    """The rows of a printed estimate: label -> the exact bytes column."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"  (\S.*?)\s{2,}\S+ \S+\s+([\d,]+)(?:  (.*))?$", line)
        if m:
            rows[m.group(1)] = (int(m.group(2).replace(",", "")), m.group(3) or "")
    return rows


@pytest.mark.parametrize("how", ["str", "cli"])
def test_the_printed_total_says_it_is_the_peak_and_what_it_adds_up(how, capsys):
    """The total row names what makes the peak, and those rows add up to it."""
    kwargs = {"batch": 2, "seq": 1024, "checkpointing": "selective"}
    if how == "str":
        text = str(estimate("gpt2-medium", **kwargs))
    else:
        assert main(["estimate", "gpt2-medium", "--batch", "2", "--seq", "1024", "--checkpointing", "selective"]) == 0
        text = capsys.readouterr().out
    rows = _byte_column(text)
    total, note = rows["total"]
    assert note == "the peak: model state (first four rows) + activations + largest temporary"
    state = [rows[k][0] for k in ("parameters", "gradients", "master weights", "optimizer state")]
    assert total == sum(state) + rows["activations"][0] + rows["largest temporary"][0]
    assert total == estimate("gpt2-medium", **kwargs).total


def test_cli_json_matches_the_api(capsys):
    argv = [
        "estimate",
        "llama-13b",
        "--batch",
        "2",
        "--seq",
        "1024",
        "--precision",
        "fp32",
        "--optimizer",
        "sgd",
        "--zero-stage",
        "2",
        "--data-parallel",
        "4",
        "--tensor-parallel",
        "2",
        "--sequence-parallel",
        "--checkpointing",
        "every-4",
        "--json",
    ]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    api = estimate(
        "llama-13b",
        batch=2,
        seq=1024,
        precision="fp32",
        optimizer="sgd",
        zero_stage=2,
        data_parallel=4,
        tensor_parallel=2,
        sequence_parallel=True,
        checkpointing=4,
    )
    assert d["bytes"] == api.to_dict()["bytes"] and d["settings"]["checkpointing"] == "every-4"


def test_cli_explicit_dimensions(capsys):
    argv = [
        "estimate",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "192",
        "--vocab",
        "100",
        "--mlp",
        "swiglu",
        "--no-tied-embeddings",
        "--seq",
        "32",
        "--attention",
        "sdpa",
        "--device-type",
        "cpu",
        "--json",
    ]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    expected = estimate(
        {
            "layers": 2,
            "hidden": 64,
            "heads": 4,
            "kv_heads": 2,
            "ffn": 192,
            "vocab": 100,
            "mlp": "swiglu",
            "tied_embeddings": False,
        },
        seq=32,
        attention="sdpa",
        device_type="cpu",
    )
    assert d["bytes"]["total"] == expected.total
    # a named model with one dimension overridden
    assert main(["estimate", "gpt2", "--layers", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["layers"] == 6


@pytest.mark.parametrize(
    "argv, match",
    [
        (["estimate", "llama-8x"], "known models: gpt2"),
        (["estimate"], "model: give a model name"),
        (["estimate", "llama-7b", "--tensor-parallel", "3"], "tensor_parallel"),
        (["estimate", "llama-7b", "--device-memory", "lots"], "device_memory"),
        (["estimate", "llama-7b", "--checkpointing", "every-x"], "checkpointing"),
        (["estimate", "llama-7b", "--zero-stage", "5"], "zero_stage"),
        (["estimate", "--layers", "2", "--hidden", "64", "--heads", "3", "--vocab", "10"], "heads"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def test_cli_non_integer_size_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "llama-7b", "--batch", "one"])
    assert exc.value.code == 2 and "--batch" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# import cost
# ---------------------------------------------------------------------------------------------
def test_estimate_by_name_does_not_import_torch():
    code = (
        "import sys, llmmem; e = llmmem.estimate('llama-7b', device_memory='80GB'); str(e); "
        "assert e.total > 0; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(_package_root()), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "False"


def _package_root():
    import pathlib

    return pathlib.Path(llmmem.__file__).resolve().parent.parent


def test_named_models_are_valid_configs():
    assert set(NAMED_MODELS) >= {"llama-7b", "llama-13b", "llama-70b", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}
    assert all(isinstance(c, ModelConfig) for c in NAMED_MODELS.values())
    assert NAMED_MODELS["llama-70b"].kv_heads == 8 and NAMED_MODELS["llama-7b"].ffn == 11008
    assert math.isclose(estimate("llama-70b").slowdown, 0.0)


def test_llmmem_estimate_stays_the_function_after_the_estimation_package_is_imported():
    code = (
        "import llmmem; llmmem.Estimate; import llmmem.estimation; from llmmem.estimation import Estimate; "
        "from llmmem import estimate; "
        "assert llmmem.estimate is estimate and callable(estimate), llmmem.estimate; "
        "print(llmmem.estimate('gpt2').total > 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(_package_root()), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
