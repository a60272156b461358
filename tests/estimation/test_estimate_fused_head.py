"""The estimator's LM head and loss both ways (issue 24, item 3): the plain head's logits, fp32
log-probabilities and gradients against the fused head's one chunk of logits
(``llmmem.linear_cross_entropy``), each against the bytes a real step holds on llmmem's GPT and a
Hugging Face Llama whose vocabulary dominates; ``fused_head=`` from the ``llmmem.patch_lm_loss``
mark; the CLI's ``--fused-head``; the ``llmmem.patch_lm_loss`` fix of a request that does not fit."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from support.diagnostics import PeftLike, opt_model
from support.planner import step_memory

import llmmem
from llmmem.__main__ import main
from llmmem.checkpointing.meters import ActivationMeter
from llmmem.diagnostics.advice import estimate_settings
from llmmem.diagnostics.live import LiveBytes
from llmmem.estimation.activations import fused_head_chunk_rows
from llmmem.head import chunks, marker
from llmmem.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _head_loss(est, which: str) -> int:
    part = est.head_loss[which]
    return part["kept"] + part["temporary"]


def _gpt(vocab: int, seq: int) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, hidden=64, heads=4, seq_len=seq, vocab_size=vocab, dropout=0.0, attention="sdpa")
    return GPT(cfg).train()


def _gpt_hidden(model: GPT, idx):
    x = model.embed(idx)
    for block in model.blocks:
        x = block(x)
    return model.ln_f(x)


def _forward_peak(model, step) -> int:
    """Activation bytes at the most of ``step()``'s forward (before its backward starts)."""
    for p in model.parameters():
        p.grad = None
    with ActivationMeter(list(model.parameters())) as meter:
        step()
    return meter.marks["backward"][1]


def _measured_gpt(model: GPT, idx, chunk_size=None) -> tuple[int, int]:
    """(plain, fused): what the head and loss add to what the trunk holds when its backward starts,
    at the step's peak (the plain head's comes in its backward) and at the fused head's (in its
    forward: the peak of its step can come later, when the tied embedding's backward adds its dense
    gradient to the head's, as it does with either head)."""

    def plain():
        model(idx, targets=idx)[1].backward()  # the logits are dropped before the backward

    def fused():
        loss = llmmem.linear_cross_entropy(_gpt_hidden(model, idx), model.head.weight, idx, chunk_size=chunk_size)
        loss.backward()

    _, trunk = step_memory(model, lambda: _gpt_hidden(model, idx).sum().backward())
    return step_memory(model, plain)[0] - trunk, _forward_peak(model, fused) - trunk


@pytest.mark.parametrize("chunk_size", [None, 64])
def test_gpt_head_and_loss_both_ways_within_5_percent_of_a_real_step(chunk_size):
    b, s, vocab = 2, 128, 16384
    model = _gpt(vocab, s)
    idx = torch.randint(0, vocab, (b, s))
    plain, fused = _measured_gpt(model, idx, chunk_size)
    est = llmmem.estimate(
        model, batch=b, seq=s, precision="fp32", device_type="cpu", fused_head=True, head_chunk_size=chunk_size
    )
    print(f"GPT chunk {chunk_size}: plain est {_head_loss(est, 'plain')} measured {plain}; fused est "
          f"{_head_loss(est, 'fused')} measured {fused}")  # fmt: skip
    assert abs(_head_loss(est, "plain") - plain) <= 0.05 * plain
    # (the fp32 weight's gradient made in the fused head's forward is among what it holds)
    assert abs(_head_loss(est, "fused") - fused) <= 0.05 * fused
    assert fused < 0.5 * plain
    rows = chunk_size or s * b  # 32 MiB hold every row here
    assert fused_head_chunk_rows(est.model, est.settings) == rows
    assert f"one chunk of logits ({rows} rows x {vocab}, fp32)" in est.temporary_terms


def _llama(vocab: int, seq: int, dtype, hidden: int = 64, layers: int = 2):
    transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg).train().to(dtype)


def test_llama_bf16_head_and_loss_both_ways_within_5_percent_of_a_real_step():
    """bf16 weights, a vocabulary of 32k over 512 tokens: the plain head's fp32 logits are 64 MiB,
    the fused head's chunks 256 rows (its 32 MiB target in fp32); on the CPU the accumulation of a
    bf16 chunk into the weight's fp32 gradient upcasts it, which the estimate counts."""
    b, s, vocab = 2, 256, 32768
    model = _llama(vocab, s, torch.bfloat16)
    ids = torch.randint(0, vocab, (b, s))
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()  # shifted as Hugging Face's loss shifts them

    def hidden():
        return model.model(input_ids=ids, use_cache=False).last_hidden_state

    _, trunk = step_memory(model, lambda: hidden().sum().backward())
    plain = step_memory(model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward())[0] - trunk
    fused = (
        step_memory(model, lambda: llmmem.linear_cross_entropy(hidden(), model.lm_head.weight, labels).backward())[0]
        - trunk
    )
    est = llmmem.estimate(model, batch=b, seq=s, precision="bf16", device_type="cpu", fused_head=True)
    print(f"Llama bf16: plain est {_head_loss(est, 'plain')} measured {plain}; fused est {_head_loss(est, 'fused')} "
          f"measured {fused}")  # fmt: skip
    assert abs(_head_loss(est, "plain") - plain) <= 0.05 * plain
    assert abs(_head_loss(est, "fused") - fused) <= 0.05 * fused
    rows = chunks.chunk_rows(b * s, vocab, b * s * 64 * 2, None)
    assert rows == fused_head_chunk_rows(est.model, est.settings) == 256
    assert "fp32 accumulator of the head weight's gradient" in est.temporary_terms
    # what the fused head saves of the peak is what the two heads' own bytes differ by here
    assert est.fused_head_saves == _head_loss(est, "plain") - _head_loss(est, "fused") > 0.6 * (plain - fused)


def _step_peaks(vocab, hidden, batch, seq, autocast: bool, accumulate: bool = False) -> tuple[int, int]:
    """(plain, fused): the most bytes one forward and backward of a one-layer Llama with fp32
    weights add to what was there before (every storage, parameter gradients included), with its own
    loss and with llmmem.patch_lm_loss's; ``accumulate``: after a first step left its gradients."""
    ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()

    peaks = []
    for patch in (False, True):
        model = _llama(vocab, seq, torch.float32, hidden=hidden, layers=1)
        if patch:
            llmmem.patch_lm_loss(model)
        with LiveBytes() as live:
            live.track([model, ids])
            if accumulate:
                step(model)
            live.reset_peak()
            base = live.allocated()
            step(model)
            peaks.append(live.max_allocated() - base)
    return peaks[0], peaks[1]


def test_autocast_with_fp32_weights_counts_the_fused_heads_16_bit_copy_of_the_weight():
    """Hugging Face's bf16=True: fp32 weights under autocast. The fused head's operand is a bf16
    copy of the head's weight (2·V·H) beside the one autocast caches for the head's own call; with
    it the estimate sees that the fused head costs a little here, as measured, instead of saving."""
    vocab, hidden, b, s = 8192, 256, 2, 128
    plain, fused = _step_peaks(vocab, hidden, b, s, autocast=True)
    model = _llama(vocab, s, torch.float32, hidden=hidden, layers=1)
    settings = estimate_settings(model, batch=b, seq=s, autocast_dtype=torch.bfloat16)
    assert settings["precision"] == "bf16-mixed"
    est = llmmem.estimate(model, **settings)
    copy = "16-bit copy of the fp32 head weight (the fused head's operand under autocast)"
    assert est.head_loss["fused"]["temporary_terms"][copy] == 2 * vocab * hidden
    print(f"autocast: fused less plain measured {fused - plain}, estimated {-est.fused_head_saves}")
    assert fused > plain and est.fused_head_saves < 0
    assert abs(-est.fused_head_saves - (fused - plain)) <= 0.03 * plain
    # 16-bit weights have no copy to make
    assert copy not in llmmem.estimate(model, batch=b, seq=s, precision="bf16", fused_head=True).temporary_terms


@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulating"])
def test_fp32_small_loss_large_vocabulary_both_heads_make_the_weight_gradient(accumulate):
    """A few tokens over a large vocabulary: the head weight's gradient outweighs the logits. The
    fused head makes it in its forward, the plain one in its backward beside the logits' gradient;
    the peaks are the same and so are the estimate's two totals."""
    vocab, hidden, b, s = 8192, 256, 1, 32
    plain, fused = _step_peaks(vocab, hidden, b, s, autocast=False, accumulate=accumulate)
    est = llmmem.estimate(
        _llama(vocab, s, torch.float32, hidden=hidden, layers=1), batch=b, seq=s, precision="fp32", device_type="cpu"
    )
    weight_grad = 4 * vocab * hidden
    print(f"fp32: fused less plain measured {fused - plain}, estimated {-est.fused_head_saves}")
    assert abs(fused - plain) <= 0.01 * weight_grad
    assert abs(est.fused_head_saves) <= 0.01 * weight_grad
    assert est.head_loss["plain"]["temporary_terms"]["head weight's gradient (made in its backward)"] == weight_grad
    assert "then its backward's matmuls make the head weight's gradient (8.00 MiB)" in str(est)
    assert est.fused_head_fix is None


@pytest.mark.parametrize(
    "n, vocab, hidden, e, chunk_size",
    [
        (1, 10, 8, 4, None),
        (512, 32768, 64, 2, None),
        (16384, 128256, 4096, 2, None),
        (8192, 128256, 256, 4, None),  # 32 MiB would be 65 rows: the 256-row floor
        (100, 128256, 8, 4, None),
        (100, 50, 8, 4, 7),
    ],
)
def test_chunk_rows_are_linear_cross_entropys(n, vocab, hidden, e, chunk_size):
    est = llmmem.estimate(
        {"layers": 1, "hidden": hidden, "heads": 1, "vocab": vocab},
        batch=1,
        seq=n,
        precision="fp32" if e == 4 else "bf16",
        fused_head=True,
        head_chunk_size=chunk_size,
    )
    assert fused_head_chunk_rows(est.model, est.settings) == chunks.chunk_rows(n, vocab, n * hidden * e, chunk_size)


def test_the_mark_makes_a_models_estimate_fused_and_gives_its_chunk_size():
    model = _gpt(1000, 32)
    plain = llmmem.estimate(model, batch=2, seq=32)
    assert not plain.settings.fused_head
    marker.mark(model, marker.FusedHead(vocab=1000, hidden=64, tied=True, chunk_size=16))
    try:
        marked = llmmem.estimate(model, batch=2, seq=32)
        assert marked.settings.fused_head and marked.settings.head_chunk_size == 16
        assert fused_head_chunk_rows(marked.model, marked.settings) == 16
        assert marked.total == marked.head_loss["fused"]["total"] and plain.total == plain.head_loss["plain"]["total"]
        what_if = llmmem.estimate(model, batch=2, seq=32, fused_head=False)  # what the plain head would take
        assert what_if.total == plain.total and what_if.fused_head_fix is None
    finally:
        marker.unmark(model)
    assert not llmmem.estimate(model, batch=2, seq=32).settings.fused_head


def test_the_largest_temporary_and_the_total_follow_the_head():
    kwargs = dict(batch=2, seq=8192, checkpointing="full", attention="sdpa", precision="bf16")
    dims = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, mlp="swiglu")
    plain = llmmem.estimate(dims, **kwargs)
    fused = llmmem.estimate(dims, **kwargs, fused_head=True)
    assert list(plain.temporary_terms) == ["fp32 gradients of log-probabilities and logits"]
    # the fused head's forward: its input, a chunk of 261 rows, the weight's fp32 accumulator and bf16 gradient
    assert "one chunk of logits (261 rows x 128256, 16-bit)" in fused.temporary_terms
    assert fused.temporary < plain.temporary / 4
    assert plain.head_loss == fused.head_loss  # both ways in either estimate
    assert plain.total == plain.head_loss["plain"]["total"] and fused.total == fused.head_loss["fused"]["total"]
    assert plain.fused_head_saves == plain.total - fused.total > 20 * 2**30
    for est, used in ((plain, "plain head (this estimate)"), (fused, "fused head (this estimate)")):
        assert used in str(est)
        assert "llmmem.patch_lm_loss: one chunk of 261 rows of logits at a time" in str(est)


def test_a_request_that_does_not_fit_is_offered_patch_lm_loss():
    kwargs = dict(batch=2, seq=8192, checkpointing="full", attention="sdpa", precision="bf16")
    dims = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, mlp="swiglu")
    est = llmmem.estimate(dims, **kwargs, optimizer="adamw-int8", step_in_backward=True, device_memory="48GiB")
    fix = est.fused_head_fix
    assert not est.fits and fix is not None and fix.fits
    assert fix.changes == {"fused_head": True} and fix.saves == est.fused_head_saves
    assert (
        fix.total
        == llmmem.estimate(dims, **kwargs, optimizer="adamw-int8", step_in_backward=True, fused_head=True).total
    )
    assert "llmmem.patch_lm_loss(model)" in str(est) and est.to_dict()["fused_head_fix"]["saves"] == fix.saves
    # not offered when the head is fused already, nor when the logits are a small part of the peak
    assert llmmem.estimate(dims, **kwargs, fused_head=True, device_memory="1GiB").fused_head_fix is None
    small = llmmem.estimate("llama-7b", seq=512, device_memory="24GiB")  # 32k vocabulary, 512 tokens
    assert not small.fits and small.fused_head_fix is None


def test_tensor_parallel_splits_the_chunks_vocabulary():
    one = llmmem.estimate("llama-7b", seq=4096, fused_head=True)
    four = llmmem.estimate("llama-7b", seq=4096, fused_head=True, tensor_parallel=4)
    assert fused_head_chunk_rows(four.model, four.settings) == 4 * fused_head_chunk_rows(one.model, one.settings)
    assert four.head_loss["plain"]["kept"] < one.head_loss["plain"]["kept"]


def test_cli_fused_head(capsys):
    argv = ["estimate", "llama-7b", "--seq", "4096", "--fused-head"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fused LM head" in text and "fused head (this estimate)" in text
    assert main(argv + ["--head-chunk-size", "100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    api = llmmem.estimate("llama-7b", seq=4096, fused_head=True, head_chunk_size=100)
    assert d["settings"]["fused_head"] is True and d["settings"]["head_chunk_size"] == 100
    assert d["bytes"] == api.to_dict()["bytes"] and d["head_loss"] == api.to_dict()["head_loss"]
    assert main(["estimate", "llama-7b", "--seq", "4096"]) == 0
    assert "plain head (this estimate)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fused_head": "yes"}, r"fused_head: must be True or False"),
        ({"head_chunk_size": 64}, r"head_chunk_size: applies to the fused head"),
        ({"fused_head": True, "head_chunk_size": 0}, r"head_chunk_size: must be a positive integer"),
        ({"fused_head": True, "head_chunk_size": 1.5}, r"head_chunk_size: must be a positive integer"),
    ],
)
def test_bad_fused_head_arguments_raise_value_error_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llmmem.estimate("gpt2", **kwargs)


@pytest.mark.cuda
def test_cuda_bf16_fused_head_within_5_percent_of_the_estimate():
    """On a GPU the passes read the chunk in place and cuBLAS accumulates the bf16 chunk into the
    fp32 gradient without a copy: the head and loss take the chunk, the fp32 accumulator, the
    hidden states and their gradient."""
    n, hidden, vocab = 8192, 1024, 65536
    h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    llmmem.linear_cross_entropy(h, w, y).backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    dims = {"layers": 1, "hidden": hidden, "heads": 8, "vocab": vocab}
    est = llmmem.estimate(dims, batch=1, seq=n, precision="bf16", fused_head=True)
    # the hidden states and the labels existed before (not measured); the peak comes as the forward
    # ends, when the bf16 weight gradient is made beside the fp32 accumulator
    assert "head weight's gradient in its dtype (made as its forward ends)" in est.temporary_terms
    expected = _head_loss(est, "fused") - n * hidden * 2 - 8 * n
    print(f"CUDA bf16: fused est {expected} measured {measured}")
    assert abs(expected - measured) <= 0.05 * measured


class _Adapted(torch.nn.Linear):
    """A linear head that computes more than its weight (as a LoRA-wrapped one)."""

    def forward(self, x):
        return super().forward(x)


def test_the_fix_offers_patch_lm_loss_only_where_it_takes_the_model():
    """An architecture patch_lm_loss refuses (OPT) is offered llmmem.linear_cross_entropy by hand,
    saying why; a PEFT wrapper the patch of the model inside it, and nothing once that one is
    patched (the mark is read through the wrapper)."""
    vocab, kwargs = 8192, dict(batch=2, seq=512, precision="fp32", device_type="cpu", device_memory="64MiB")
    opt = opt_model(vocab)
    with pytest.raises(TypeError, match="not an architecture it knows"):
        llmmem.patch_lm_loss(opt)
    fix = llmmem.estimate(opt, **kwargs).fused_head_fix
    assert fix is not None and "patch_lm_loss(model)" not in fix.change + fix.code
    assert fix.change.startswith("llmmem.linear_cross_entropy in the model's loss (llmmem.patch_lm_loss refuses it:")
    assert "OPTForCausalLM is not an architecture it knows)" in fix.change
    assert fix.code.startswith("loss = llmmem.linear_cross_entropy(hidden, lm_head.weight, labels)")

    llama = _llama(vocab, 512, torch.float32)
    assert llmmem.estimate(llama, **kwargs).fused_head_fix.code == "handle = llmmem.patch_lm_loss(model)"
    wrapped = PeftLike(llama)
    with pytest.raises(TypeError, match="not an architecture it knows"):
        llmmem.patch_lm_loss(wrapped)
    fix = llmmem.estimate(wrapped, **kwargs).fused_head_fix
    assert fix.change == "llmmem.patch_lm_loss(model.get_base_model())"
    handle = llmmem.patch_lm_loss(wrapped.get_base_model())  # what the fix says, which works
    try:
        est = llmmem.estimate(wrapped, **kwargs)
        assert est.settings.fused_head and est.fused_head_fix is None
    finally:
        handle.remove()
    fix = llmmem.estimate(PeftLike(opt), **kwargs).fused_head_fix  # the model inside is refused: by hand
    assert "OPTForCausalLM is not an architecture it knows)" in fix.change
    assert fix.code.startswith("loss = llmmem.linear_cross_entropy")
    # a head with an adapter: its weight alone is not the head, so nothing is offered
    llama.lm_head.__class__ = _Adapted
    assert llmmem.estimate(wrapped, **kwargs).fused_head_fix is None
    assert llmmem.estimate(llama, **kwargs).fused_head_fix is None
