"""How much accelerator memory will training take, and what makes it fit?

``llmmem.estimate(model, batch=..., seq=..., ...)`` returns an :class:`Estimate`: a per-device
breakdown in bytes (not elements) of parameters, gradients, master weights, optimizer state,
activations and the largest transient buffer. Given ``device_memory`` it says whether that fits
and which combination of activation checkpointing, ZeRO stage, tensor/sequence parallelism and
fused attention fits with the least expected slowdown. Pure arithmetic: naming a model imports
neither torch nor the C core.

Model state, bytes per parameter (Rajbhandari et al. 2020, "ZeRO", section 3.1: mixed-precision
Adam needs ``2Ψ + 2Ψ + KΨ`` bytes with ``K = 12``, i.e. 16 bytes per parameter):

================  =====  =====  ======  ============================================
precision         param  grad   master  optimizer state per moment
================  =====  =====  ======  ============================================
``fp32``          4      4      0       4 (fp32)
``fp16-mixed``    2      2      4       4 (fp32 moments beside the fp32 master copy)
``bf16-mixed``    2      2      4       4
``bf16`` (pure)   2      2      0       2 (bf16 moments, no fp32 copy)
================  =====  =====  ======  ============================================

Moments per parameter: ``sgd`` 0, ``sgd-momentum`` 1, ``adam``/``adamw`` 2 (Kingma & Ba 2015), so
Adam's state is 8 bytes per parameter in fp32 and mixed-precision Adam totals 2+2+4+8 = 16.
(``torch.autocast`` with fp32 parameters also totals 16 with Adam, as 4+4+0+8, and has 16-bit
activations like the ``*-mixed`` modes.)

:mod:`llmmem.optim`'s Adam/AdamW (``adamw-fp32``, ``adamw-bf16``, ``adamw-int8``, ``adamw-int4``
and the same ``adam-*``) keep their moments in their own format whatever the precision, counted
tensor by tensor (:mod:`llmmem.estimation.model_state`): 8, 4, ``2 + 8/256`` or ``1 + 8/128``
bytes per parameter, tensors under ``min_quantized_numel`` (4096) elements in fp32. They update
bf16 weights with stochastic rounding and keep an fp32 master only when asked: precision
``bf16`` (or ``master_weights=False``) is bf16 weights without a master. With
``step_in_backward`` each gradient is freed as soon as its parameter is stepped, so at most the
largest tensor's gradient is held instead of all of them.

ZeRO partitioning over ``N_d`` data-parallel ranks (Rajbhandari et al. 2020, section 5): stage 1
divides the optimizer state and master weights by ``N_d``, stage 2 also the gradients, stage 3
also the parameters. Tensor parallelism (Shoeybi et al. 2019) divides every weight matrix and the
vocabulary by ``t``; norms and row-parallel biases are replicated (see :mod:`llmmem.estimation.model_configs`).

Activations: see :func:`layer_activation_terms` (derived from what each op saves for backward;
Megatron-LM's ``s·b·h·(34 + 5·a·s/h)`` is its 16-bit special case, :func:`megatron_layer_activation_bytes`)
and :func:`other_activation_terms` (embeddings, final norm, head and loss). The head and loss
(:func:`~llmmem.estimation.activations.head_loss_terms`) are counted both ways, the plain head
(``[tokens x vocab]`` logits, their fp32 log-probabilities and gradients) and the fused one
(``llmmem.patch_lm_loss`` / ``llmmem.linear_cross_entropy``: one chunk of logits at a time), so
that an estimate says what the fused head saves; ``fused_head`` picks the one the total counts.

Assumptions: every quantity is per device and summed at once (activations are at their peak at the
start of backward, when gradients start to appear), which is conservative; no pipeline parallelism,
no CPU offload; ``batch`` is the micro-batch per data-parallel rank; ``device_memory`` is what the
process may allocate, so leave room yourself for the CUDA context (~0.5-1 GiB), NCCL buffers and
allocator fragmentation.
"""

from __future__ import annotations

import dataclasses

from llmmem.estimation import model_configs
from llmmem.estimation.activations import (
    fused_head_chunk_rows,
    layer_activation_terms,
    megatron_layer_activation_bytes,
    other_activation_terms,
)
from llmmem.estimation.breakdown import compute as _compute
from llmmem.estimation.model_configs import ModelConfig, positive_int
from llmmem.estimation.recommend import (
    MAX_DEVICES,
    Recommendation,
    changes_between,
    fused_head_fix,
    model_state_fixes,
    search,
)
from llmmem.estimation.recommend import pct as _pct
from llmmem.estimation.settings import OPTIMIZERS, PRECISIONS
from llmmem.estimation.settings import Settings as _Settings
from llmmem.estimation.settings import make_settings as _settings
from llmmem.units import format_bytes, parse_bytes

__all__ = [
    "estimate",
    "Estimate",
    "Recommendation",
    "ModelConfig",
    "layer_activation_terms",
    "other_activation_terms",
    "megatron_layer_activation_bytes",
    "PRECISIONS",
    "OPTIMIZERS",
]


# =================================================================================================
# the estimate
# =================================================================================================
class Estimate:
    """A per-device memory estimate (bytes). Build it with :func:`estimate`.

    Attributes (bytes unless said otherwise): ``parameters``, ``gradients``, ``master_weights``,
    ``optimizer_state``, ``activations`` (= ``activations_layers`` + ``activations_other``),
    ``activations_per_layer`` (one layer without recompute), ``activations_layers`` (all layers,
    under the chosen checkpointing), ``activations_other`` (embeddings, head, loss),
    ``temporary`` (largest transient buffer), ``total`` (the peak: model state + activations +
    temporary, every gradient held throughout, as under gradient accumulation), ``peak`` (the
    peak of a step that starts without gradients, ``zero_grad(set_to_none=True)``: the larger of
    model state without gradients + activations + the head's or the last layer's backward
    transients (less what the head and that layer's MLP freed first), when backward starts, and
    model state with every gradient + one layer's backward transients, when it ends; at most
    ``total``); ``layer_terms``, ``other_terms`` and ``temporary_terms`` break those down;
    ``parameter_count`` (elements, whole model), ``slowdown`` (fraction); with ``device_memory``:
    ``fits`` (bool), ``recommendation`` (:class:`Recommendation` or None), ``advice`` (one line)
    and ``model_state_fixes`` (:class:`~llmmem.estimation.recommend.ModelStateFix`: changes of the
    optimizer, the weights' precision and the step that save model state, largest saving first;
    filled when the request does not fit) and ``fused_head_fix`` (the same kind of record for
    ``llmmem.patch_lm_loss(model)``, or ``llmmem.linear_cross_entropy`` by hand for a model it does
    not patch, when the request does not fit with the plain head and its logits are a large part
    of the peak, else None). ``state_terms`` says what the model
    state is made of with an llmmem optimizer or a step in backward (bytes a parameter, tensors
    kept in fp32, the largest gradient's elements). ``head_loss``: the LM head and loss both ways,
    ``{"plain": {...}, "fused": {...}}``, each with ``kept`` (activations), ``temporary`` (their
    largest transient buffer) and ``total`` (the peak with that head; the settings'
    ``fused_head`` says which one ``total`` is); ``fused_head_saves`` is the plain total less the
    fused one (bytes).
    """

    def __init__(self, cfg: ModelConfig, st: _Settings, numbers_: dict, device_memory: int | None = None) -> None:
        self.model = cfg
        self.settings = st
        self.parameter_count = numbers_["parameter_count"]
        self.parameters_per_device = numbers_["parameters_per_device"]
        for key, value in numbers_["bytes"].items():
            setattr(self, key, value)
        self.layer_terms = numbers_["layer_terms"]
        self.other_terms = numbers_["other_terms"]
        self.temporary_terms = numbers_["temporary_terms"]
        self.state_terms = numbers_["state_terms"]
        self.head_loss = numbers_["head_loss"]
        self.slowdown = numbers_["slowdown"]
        self.slowdown_terms = numbers_["slowdown_terms"]
        self.device_memory = device_memory
        self.fits = None if device_memory is None else self.total <= device_memory
        self.recommendation: Recommendation | None = None
        self.advice = ""
        self.model_state_fixes: list = []
        self.fused_head_fix = None
        # estimate(measure=): the measured bytes of one layer (in the module's dtype) and the factor
        # the layer terms were scaled by
        self.measured_layer_bytes: int | None = None
        self.layer_scale = 1.0

    _ROWS = ("parameters", "gradients", "master_weights", "optimizer_state", "activations", "temporary", "total")

    @property
    def fused_head_saves(self) -> int:
        """Bytes of the peak the fused head saves over the plain one (llmmem.patch_lm_loss)."""
        return self.head_loss["plain"]["total"] - self.head_loss["fused"]["total"]

    @property
    def model_state(self) -> int:
        """Parameters, gradients, master weights and optimizer state (bytes)."""
        return self.parameters + self.gradients + self.master_weights + self.optimizer_state

    def to_dict(self) -> dict:
        """Every number, in bytes (fractions for slowdowns), JSON-ready."""
        return {
            "model": {
                **{f.name: getattr(self.model, f.name) for f in dataclasses.fields(self.model)},
                "parameter_count": self.parameter_count,
                "parameters_per_device": self.parameters_per_device,
            },
            "settings": self.settings.public(),
            "bytes": {
                k: getattr(self, k)
                for k in self._ROWS + ("peak", "activations_per_layer", "activations_layers", "activations_other")
            },
            "layer_terms": dict(self.layer_terms),
            "measured_layer_bytes": self.measured_layer_bytes,
            "layer_scale": self.layer_scale,
            "other_terms": dict(self.other_terms),
            "temporary_terms": dict(self.temporary_terms),
            "state_terms": dict(self.state_terms),
            "head_loss": {k: dict(v) for k, v in self.head_loss.items()},
            "fused_head_saves": self.fused_head_saves,
            "slowdown": self.slowdown,
            "slowdown_terms": dict(self.slowdown_terms),
            "device_memory": self.device_memory,
            "fits": self.fits,
            "recommendation": None if self.recommendation is None else self.recommendation.to_dict(),
            "advice": self.advice,
            "model_state_fixes": [f.to_dict() for f in self.model_state_fixes],
            "fused_head_fix": None if self.fused_head_fix is None else self.fused_head_fix.to_dict(),
        }

    def __str__(self) -> str:
        cfg, st = self.model, self.settings
        prec = PRECISIONS[st.precision]
        moments = OPTIMIZERS[st.optimizer]
        sp = ", sequence parallel" if st.sequence_parallel and st.tensor_parallel > 1 else ""
        opt = st.optimizer
        if st.state_dtype in ("int8", "int4"):
            opt += f" (block {st.block_size})"
        if st.step_in_backward:
            opt += ", step in backward"
        head = ", fused LM head" if st.fused_head else ""
        target = f" (decoder {st.decoder_seq})" if cfg.architecture == "encoder-decoder" else ""
        lines = [
            f"{cfg.name}: {self.parameter_count / 1e9:.3g} B parameters ({cfg.describe()})",
            f"batch {st.batch} x seq {st.seq}{target}, {st.precision}, {opt}, ZeRO stage {st.zero_stage} over "
            f"{st.data_parallel} data-parallel rank(s), tensor parallel {st.tensor_parallel}{sp}, "
            f"checkpointing {st.checkpointing}, {st.attention} attention{head} ({st.device_type})",
            "",
            f"{'per device':<44}{'':>12}{'bytes':>20}",
        ]

        def row(label: str, value: int, note: str = "") -> None:
            lines.append(f"  {label:<42}{format_bytes(value):>12} {value:>19,}" + (f"  {note}" if note else ""))

        terms = self.state_terms
        row("parameters", self.parameters, f"{prec['param']} B/param")
        if st.step_in_backward:
            grad_note = (
                f"step in backward: the largest tensor's only ({terms['largest_gradient_numel']:,} elements x "
                f"{prec['grad']} B)"
            )
        else:
            grad_note = f"{prec['grad']} B/param"
        row("gradients", self.gradients, grad_note)
        if st.state_dtype is None:
            master_note = f"{4 if st.master_weights else 0} B/param"
            state_note = f"{moments} x {prec['moment']} B/param"
        else:
            master_note = (
                "4 B/param (llmmem.optim master_weights=True)"
                if st.master_weights
                else (
                    "none: fp32 weights"
                    if st.precision == "fp32"
                    else "none: bf16 weights updated with stochastic rounding"
                )
            )
            state_note = f"llmmem.optim {st.state_dtype} moments, {terms['state_bytes_per_parameter']:.3f} B/param"
            if terms["kept_fp32_tensors"]:
                state_note += (
                    f" ({terms['kept_fp32_tensors']} tensors under {st.min_quantized_numel} elements keep fp32, "
                    f"{terms['kept_fp32_numel']:,} elements)"
                )
        row("master weights", self.master_weights, master_note)
        row("optimizer state", self.optimizer_state, state_note)
        row("activations", self.activations)
        row("  per layer (no recompute)", self.activations_per_layer)
        row(f"  all {cfg.total_layers} layers ({st.checkpointing})", self.activations_layers)
        row("  embeddings, head, loss", self.activations_other)
        row("largest temporary", self.temporary, "; ".join(self.temporary_terms))
        row("total", self.total, "the peak: model state (first four rows) + activations + largest temporary")
        row(
            "  a step from no gradients",
            self.peak,
            "zero_grad(set_to_none=True): the larger of backward's start (no gradient yet) and its end (no "
            "activation left)",
        )
        if cfg.vocab_head:
            self._head_rows(lines, row)
        else:
            plain = self.head_loss["plain"]
            row(
                f"{cfg.task} head and loss",
                plain["kept"] + plain["temporary"],
                f"{cfg.num_labels} labels, no vocabulary-sized head: kept {format_bytes(plain['kept'])}",
            )
        if self.slowdown_terms:
            parts = ", ".join(f"{k} {_pct(v)}" for k, v in self.slowdown_terms.items())
            lines.append(f"expected slowdown {_pct(self.slowdown)} ({parts})")
        if self.device_memory is not None:
            lines.append("")
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(
                f"device memory {format_bytes(self.device_memory)} ({self.device_memory:,} bytes): {verdict} "
                f"({format_bytes(abs(self.device_memory - self.total))} "
                f"{'free' if self.fits else 'short'})"
            )
            left = self.device_memory - self.model_state
            need = self.activations + self.temporary
            if left > 0:
                lines.append(
                    f"model state {format_bytes(self.model_state)}: {format_bytes(left)} left for activations and "
                    f"temporaries (this step needs {format_bytes(need)})"
                )
            else:
                lines.append(
                    f"model state {format_bytes(self.model_state)}: alone {format_bytes(-left)} more than the device "
                    f"memory, nothing left for activations and temporaries (this step needs {format_bytes(need)})"
                )
            if self.advice:
                lines.append(self.advice)
            if self.model_state_fixes:
                lines.append(
                    "changes of the model state (they change the optimizer or the weights' precision, so the "
                    "recommendation above does not make them), largest saving first:"
                )
                lines += [f"  {fix.describe()}" for fix in self.model_state_fixes]
            if self.fused_head_fix is not None:
                lines.append(
                    "a change of how the loss is computed (the LM head and loss one chunk of logits at a time; the "
                    "recommendation above does not make it):"
                )
                lines.append(f"  {self.fused_head_fix.describe()}")
        return "\n".join(lines)

    def _head_rows(self, lines: list, row) -> None:
        """The LM head and loss both ways (plain and fused), for a model with a vocabulary head."""
        cfg, st = self.model, self.settings
        lines.append("LM head and loss, kept + their largest temporary, both ways:")
        plain, fused = self.head_loss["plain"], self.head_loss["fused"]
        used = " (this estimate)"
        later = (
            f"their and the logits' fp32 gradients {format_bytes(plain['temporary'])}"
            if "fp32 gradients of log-probabilities and logits" in plain["temporary_terms"]
            else f"then its backward's matmuls make the head weight's gradient ({format_bytes(_weight_gradient(plain))})"
        )
        row(
            "plain head" + ("" if st.fused_head else used),
            plain["kept"] + plain["temporary"],
            f"[tokens x vocab] logits: fp32 log-probabilities kept {format_bytes(plain['kept'])}, {later}",
        )
        rows_ = fused_head_chunk_rows(cfg, st)
        saves = self.fused_head_saves
        wgrad = _weight_gradient(fused)
        row(
            "fused head" + (used if st.fused_head else ""),
            fused["kept"] + fused["temporary"],
            f"llmmem.patch_lm_loss: one chunk of {rows_} rows of logits at a time, and the head weight's gradient "
            f"({format_bytes(wgrad)}) made in its forward; the peak "
            + (f"{format_bytes(saves)} lower" if saves >= 0 else f"{format_bytes(-saves)} higher"),
        )

    def __repr__(self) -> str:
        return f"<Estimate {self.model.name}: total {format_bytes(self.total)} per device>"


def _weight_gradient(head: dict) -> int:
    """Bytes of the head weight's gradient (and its fp32 accumulator) among a head's temporaries."""
    return sum(v for k, v in head["temporary_terms"].items() if "weight's gradient" in k or "accumulator" in k)


# =================================================================================================
# the fit recommendation (the search is llmmem.estimation.recommend)
# =================================================================================================
def _recommend(est: Estimate, counted: int | None, shapes, model=None) -> None:
    cfg, st, budget = est.model, est.settings, est.device_memory
    if not est.fits:
        est.model_state_fixes = model_state_fixes(cfg, counted, st, budget, est.layer_scale, shapes)
        est.fused_head_fix = fused_head_fix(cfg, counted, st, budget, est.layer_scale, shapes, model)
    found = search(cfg, counted, st, budget, est.layer_scale, shapes)
    if found is None:
        est.advice = (
            f"impossible: no combination of checkpointing, ZeRO, tensor/sequence parallelism and fused "
            f"attention fits {format_bytes(budget)} per device on up to {MAX_DEVICES} devices"
        )
        return
    devices, ((slowdown, _, _), cand) = found
    if est.fits and slowdown >= est.slowdown - 1e-9:
        est.advice = "the requested settings are already the cheapest that fit"
        return
    rec_est = Estimate(cfg, cand, _compute(cfg, counted, cand, est.layer_scale, shapes), budget)
    rec_est.layer_scale = est.layer_scale
    est.recommendation = Recommendation(
        settings=cand.public(),
        changes=changes_between(st, cand),
        devices=devices,
        slowdown=rec_est.slowdown,
        estimate=rec_est,
    )
    if est.fits:
        head = "fits; a faster combination that also fits"
    elif devices == st.devices:
        head = "to fit"
    else:
        head = (
            f"cannot fit on {st.devices} device(s) with any combination; smallest set-up that fits "
            f"uses {devices} devices"
        )
    est.advice = f"recommendation ({head}): {est.recommendation.describe()}"


def estimate(
    model,
    *,
    batch: int = 1,
    seq: int | None = None,
    target_seq: int | None = None,
    task: str | None = None,
    precision: str = "bf16-mixed",
    optimizer: str = "adam",
    zero_stage: int = 0,
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    checkpointing="none",
    attention: str | None = None,
    device_type: str = "cuda",
    device_memory=None,
    measure=False,
    master_weights=None,
    step_in_backward: bool = False,
    block_size=None,
    min_quantized_numel=None,
    fused_head=None,
    head_chunk_size=None,
) -> Estimate:
    """Estimate the per-device memory of training ``model``; optionally, what makes it fit.

    :param model: a name (``llama-7b``, ``llama-13b``, ``llama-70b``, ``gpt2``, ``gpt2-medium``,
        ``gpt2-large``, ``gpt2-xl``; case-insensitive), a dict or dataclass of dimensions
        (``layers, hidden, heads, vocab`` and optionally ``kv_heads, ffn, mlp ("gelu"|"swiglu"),
        activation, norm, fused_norm, tied_embeddings, positions, max_positions, bias, dropout,
        attention``; see :class:`llmmem.estimation.model_configs.ModelConfig`), a Hugging Face config
        (``model.config``: its architecture is read too: norm, activation, grouped key/value heads,
        positions, biases, dropout, attention implementation), or an ``nn.Module`` whose parameters
        are counted and whose ``cfg``/``config`` gives the dimensions. Training is assumed to run
        without a key/value cache (``use_cache=False``).
        Encoder-decoders (T5, mT5, BART, mBART: both stacks, cross-attention) and encoders with a
        task head (BERT, RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT, ViT) are read too; hybrids and
        other architectures are refused by name (ValueError).
    :param batch: micro-batch per data-parallel rank. :param seq: sequence length (an
        encoder-decoder's encoder's); None: 2048, or for an image model the tokens its image makes
        (ViT: ``(image_size / patch_size)^2 + 1``).
    :param target_seq: an encoder-decoder's decoder length (its layers, their cross-attention over
        ``seq`` tokens, and the head and loss run at it); None: ``seq``. Refused for other models.
    :param task: the head: ``"causal-lm"`` (decoders), ``"seq2seq-lm"`` (encoder-decoders),
        ``"sequence-classification"``, ``"token-classification"``, ``"question-answering"``
        (BERT-style: a start and an end logit a token), ``"masked-lm"``, ``"image-classification"``
        (encoders; only ``masked-lm`` has a vocabulary-sized head). An encoder-decoder's encoder-only
        class (``T5EncoderModel``) is refused by name.
        None: what a Hugging Face model's class says (``BertForSequenceClassification``), else the
        config's ``architectures``, else the family's default (an encoder-decoder ``seq2seq-lm``,
        ViT ``image-classification``, a text encoder ``sequence-classification`` with the
        config's ``num_labels``); the estimate's description names it.
    :param precision: ``fp32``; ``fp16-mixed`` / ``bf16-mixed`` (16-bit parameters, gradients and
        activations with an fp32 master copy and fp32 optimizer state); ``bf16`` (pure bf16, no
        fp32 copy).
    :param optimizer: torch's ``sgd``, ``sgd-momentum``, ``adam``, ``adamw`` (moments in the
        precision's dtype); or :mod:`llmmem.optim`'s ``adamw-fp32``, ``adamw-bf16``, ``adamw-int8``,
        ``adamw-int4`` (and ``adam-*``), whose moments are counted tensor by tensor in their format.
    :param master_weights: None: what the precision says (``*-mixed``: an fp32 master, 4 B/param;
        ``bf16``, ``fp32``: none). With an llmmem optimizer, True or False says whether it keeps an
        fp32 master of the 16-bit weights (``False``: bf16 weights updated with stochastic
        rounding; fp16 weights need the master). A torch optimizer keeps none of its own: a value
        that contradicts the precision is refused.
    :param step_in_backward: :func:`llmmem.optim.step_in_backward`: each gradient is freed once its
        parameter is stepped, so only the largest tensor's gradient is counted (one data-parallel
        rank only).
    :param block_size: elements per scale of ``*-int8`` / ``*-int4`` (default 256 / 128).
    :param min_quantized_numel: tensors with fewer elements keep fp32 moments in ``*-int8`` /
        ``*-int4`` (default 4096).
    :param fused_head: the LM head and loss computed by ``llmmem.linear_cross_entropy`` (what
        ``llmmem.patch_lm_loss(model)`` does): one chunk of logits at a time instead of the
        ``[tokens x vocab]`` logits, their fp32 log-probabilities and gradients (see
        :func:`~llmmem.estimation.activations.head_loss_terms`). None: whether ``model`` is an
        ``nn.Module`` carrying the mark ``llmmem.patch_lm_loss`` leaves (False for a name or a
        config). Either way the estimate shows the head and loss both ways (``head_loss``).
    :param head_chunk_size: rows of logits a chunk of the fused head (its ``chunk_size``); None:
        the marked model's, else the memory target ``linear_cross_entropy`` chooses by.
    :param zero_stage: 0-3, over ``data_parallel`` ranks. :param tensor_parallel: Megatron TP size;
        must divide heads, kv_heads and ffn. :param sequence_parallel: also split the norm/dropout
        activations by ``t`` (no effect when ``t = 1``).
    :param checkpointing: ``"none"``; ``"selective"`` (recompute the attention core, Megatron);
        ``"full"`` (every layer keeps only its input); ``"every-K"`` or an int ``K``: layers
        0, K, 2K, ... are recomputed and the others keep their activations (``K = 1`` is full).
    :param attention: ``"explicit"`` or ``"sdpa"`` (fused kernel); default: the model's.
    :param device_type: ``"cuda"`` (dropout keeps 1-byte masks) or ``"cpu"`` (dropout keeps a noise
        tensor of the activation dtype).
    :param device_memory: bytes per device (``80e9``, ``"80GB"``, ``"80GiB"``); when given, the
        estimate says whether it fits and recommends the combination with the least expected
        slowdown (see ``_slowdown`` for the cost model).
    :param measure: for an ``nn.Module``: ``True`` (token ids of ``batch x seq``) or a batch of the
        model's inputs (a tensor, tuple or dict): run the model's first repeated block once on what
        the model gives it, measure the bytes it keeps for backward, and scale the layer terms so
        that they add up to that for the module's own dtype and device (what the formulas cannot
        see: a custom norm or activation, extra saved tensors). Imports torch; memory: one block.
    :raises ValueError: naming the argument, for any invalid input.
    """
    cfg, counted = model_configs.resolve(model, task=task)
    if seq is None:
        seq = cfg.image_tokens or 2048
    mark = model_configs.fused_head_mark(model)
    if fused_head is None:
        fused_head = mark is not None
    if head_chunk_size is None and fused_head is True and mark is not None:
        head_chunk_size = mark.chunk_size
    shapes = None if counted is None else tuple(tuple(p.shape) for p in model.parameters())
    layer_scale, measured = 1.0, None
    if measure is not False:
        if counted is None:
            raise ValueError("measure: needs an nn.Module to run (got a name or dimensions)")
        from llmmem.estimation.measure import measure_layer_bytes, model_settings

        if measure is True:
            import torch

            if cfg.architecture == "encoder-decoder" or not cfg.vocab:
                raise ValueError(
                    f"measure: True makes token ids for a decoder; this {cfg.architecture} needs a batch of its own "
                    "inputs (a dict: input_ids and labels, or pixel_values)"
                )

            p = next(model.parameters())
            sample = torch.randint(
                0, cfg.vocab, (positive_int(batch, "batch"), positive_int(seq, "seq")), device=p.device
            )
        else:
            sample = measure
        measured = measure_layer_bytes(model, sample)
        native_precision, native_device = model_settings(model)
        as_run = _settings(
            cfg,
            batch=batch,
            seq=seq,
            precision=native_precision,
            optimizer=optimizer,
            zero_stage=0,
            data_parallel=1,
            tensor_parallel=1,
            sequence_parallel=False,
            checkpointing="none",
            attention=attention,
            device_type=native_device,
            master_weights=None,
            step_in_backward=False,
            block_size=block_size,
            min_quantized_numel=min_quantized_numel,
        )
        layer_scale = measured / sum(layer_activation_terms(cfg, as_run).values())
    st = _settings(
        cfg,
        batch=batch,
        seq=seq,
        precision=precision,
        optimizer=optimizer,
        zero_stage=zero_stage,
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        checkpointing=checkpointing,
        attention=attention,
        device_type=device_type,
        master_weights=master_weights,
        step_in_backward=step_in_backward,
        block_size=block_size,
        min_quantized_numel=min_quantized_numel,
        fused_head=fused_head,
        head_chunk_size=head_chunk_size,
        target_seq=target_seq,
    )
    budget = None
    if device_memory is not None:
        budget = parse_bytes(device_memory, "device_memory")
        if budget == 0:
            raise ValueError("device_memory: must be more than 0 bytes")
    est = Estimate(cfg, st, _compute(cfg, counted, st, layer_scale, shapes), budget)
    est.layer_scale, est.measured_layer_bytes = layer_scale, measured
    if budget is not None:
        _recommend(est, counted, shapes, model)
    return est
