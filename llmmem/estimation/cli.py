"""``python -m llmmem estimate``: the estimator on a named model, a Hugging Face ``config.json`` (or a
directory holding one, read offline), or explicit dimensions."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

from llmmem.estimation import model_configs
from llmmem.estimation.estimator import OPTIMIZERS, PRECISIONS, estimate
from llmmem.estimation.model_configs import ModelConfig
from llmmem.units import MAX_BYTES, format_bytes

__all__ = ["register_cli"]


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="memory needed to train a model, and what makes it fit",
        description="Per-device training memory (bytes) for a named model, a Hugging Face config.json (or a "
        "directory holding one) or explicit dimensions.",
    )
    p.add_argument(
        "model",
        nargs="?",
        help=f"one of: {', '.join(model_configs.NAMED_MODELS)}; or a Hugging Face config.json, or a directory "
        "holding one (read offline); or give --layers --hidden --heads --vocab ...",
    )
    p.add_argument("--batch", type=int, default=1, help="micro-batch per data-parallel rank (default 1)")
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="sequence length, an encoder-decoder's encoder's (default 2048; an image model: its image's tokens)",
    )
    p.add_argument(
        "--target-seq",
        type=int,
        default=None,
        help="an encoder-decoder's decoder length (T5, BART; default: --seq)",
    )
    p.add_argument(
        "--task",
        default=None,
        help="the head: seq2seq-lm, sequence-classification, token-classification, question-answering, "
        "masked-lm, image-classification, causal-lm (default: the config's architectures, else the family's: an encoder's "
        "sequence-classification)",
    )
    p.add_argument("--precision", default=None, help=f"{', '.join(PRECISIONS)} (default bf16-mixed)")
    p.add_argument(
        "--optimizer",
        "--optim",
        default="adam",
        help=f"{', '.join(OPTIMIZERS)} (default adam); adam(w)-fp32/bf16/int8/int4 are llmmem.optim's",
    )
    p.add_argument(
        "--bf16-weights",
        action="store_true",
        help="bf16 weights without an fp32 master (precision bf16; llmmem.optim updates them with stochastic "
        "rounding)",
    )
    p.add_argument(
        "--master-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether an llmmem.optim optimizer keeps an fp32 master of 16-bit weights (default: what the "
        "precision says: the *-mixed ones keep one)",
    )
    p.add_argument(
        "--step-in-backward",
        action="store_true",
        help="llmmem.optim.step_in_backward: each gradient freed once its parameter is stepped",
    )
    p.add_argument(
        "--fused-head",
        action="store_true",
        help="the LM head and loss as llmmem.patch_lm_loss computes them (llmmem.linear_cross_entropy: one "
        "chunk of logits at a time); the estimate shows the head and loss both ways either way",
    )
    p.add_argument(
        "--head-chunk-size",
        type=int,
        default=None,
        help="rows of logits a chunk of the fused head (default: its memory target)",
    )
    p.add_argument("--block-size", type=int, default=None, help="elements per scale of *-int8 / *-int4 (256 / 128)")
    p.add_argument(
        "--min-quantized-numel",
        type=int,
        default=None,
        help="tensors with fewer elements keep fp32 moments in *-int8 / *-int4 (default 4096)",
    )
    p.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage 0-3 (default 0)")
    p.add_argument("--data-parallel", type=int, default=1, help="data-parallel size (default 1)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism")
    p.add_argument(
        "--checkpointing",
        "--checkpoint",
        default="none",
        type=_checkpointing_arg,
        help="none, selective, full (or all), every-K or K (recompute every K-th layer; default none)",
    )
    p.add_argument("--attention", default=None, help="explicit or sdpa (default: the model's; explicit)")
    p.add_argument("--device-type", default="cuda", help="cuda or cpu (default cuda)")
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB, 80GiB or bytes")
    p.add_argument("--json", action="store_true", help="print every number as JSON (bytes)")
    dims = p.add_argument_group("explicit dimensions (override a named model's, or describe an unnamed one)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
        dims.add_argument(f"--{flag}", type=int, default=None)
    dims.add_argument("--mlp", default=None, help="gelu or swiglu")
    dims.add_argument(
        "--tied-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="output head shares the token embedding",
    )
    # Values may start with '-' ("--device-memory -1GB" must reach the validation that names the
    # option): Python < 3.13 takes such a value for an option unless it is a plain number, and
    # then reports "expected one argument". This is the rule Python 3.13 adopted.
    if hasattr(p, "_negative_number_matcher"):
        p._negative_number_matcher = re.compile(r"^-\.?\d")
    p.set_defaults(func=_run_cli)


def _checkpointing_arg(text: str):
    """``"4"`` is the integer form K of the estimator's ``checkpointing`` (every 4th layer)."""
    return int(text) if text.strip().isdigit() else text


def _named_or_file(text: str, task: str | None = None) -> ModelConfig:
    """A named model, else a Hugging Face config file (or a directory holding config.json), read
    for ``task``'s head."""
    if text.strip().lower() in model_configs.NAMED_MODELS:
        return model_configs.lookup(text)
    if os.path.exists(text) or os.sep in text or "/" in text or text.endswith(".json"):
        return model_configs.read_hf_config_file(text, name="model", task=task)
    raise ValueError(
        f"model: unknown model name {text!r} and no such file; known models: {', '.join(model_configs.NAMED_MODELS)}; "
        "or give a Hugging Face config.json or a directory holding one, or explicit dimensions (--layers --hidden "
        "--heads --vocab)"
    )


def _run_cli(args) -> int:
    overrides = {
        k: getattr(args, k)
        for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "mlp", "tied_embeddings")
        if getattr(args, k) is not None
    }
    if args.model is not None:
        model = _named_or_file(args.model, args.task)
        if overrides:
            fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
            if "mlp" in overrides and "ffn" not in overrides:
                fields["ffn"] = None  # re-derive the width for the new MLP kind
            if "heads" in overrides and "kv_heads" not in overrides:
                fields["kv_heads"] = None
            fields.update(overrides, name=f"{model.name} (modified)")
            model = ModelConfig(**fields)
    elif overrides:
        model = model_configs.from_mapping(overrides)
    else:
        raise ValueError(
            f"model: give a model name ({', '.join(model_configs.NAMED_MODELS)}) "
            "or explicit dimensions (--layers --hidden --heads --vocab)"
        )
    precision = args.precision
    if args.bf16_weights:
        if precision is not None and precision.strip().lower() != "bf16":
            raise ValueError(
                f"--bf16-weights: means precision bf16 (bf16 weights without an fp32 master), not --precision "
                f"{precision}; give one of them"
            )
        precision = "bf16"
    est = estimate(
        model,
        batch=args.batch,
        seq=args.seq,
        target_seq=args.target_seq,
        task=args.task,
        precision="bf16-mixed" if precision is None else precision,
        optimizer=args.optimizer,
        zero_stage=args.zero_stage,
        data_parallel=args.data_parallel,
        tensor_parallel=args.tensor_parallel,
        sequence_parallel=args.sequence_parallel,
        checkpointing=args.checkpointing,
        attention=args.attention,
        device_type=args.device_type,
        device_memory=args.device_memory,
        master_weights=args.master_weights,
        step_in_backward=args.step_in_backward,
        block_size=args.block_size,
        min_quantized_numel=args.min_quantized_numel,
        fused_head=args.fused_head,
        head_chunk_size=args.head_chunk_size,
    )
    if est.total > MAX_BYTES:
        # The figures are exact, but no memory holds them and the table has no room for them.
        raise ValueError(
            f"--seq {est.settings.seq} with --batch {args.batch}: training needs {format_bytes(est.total)} "
            f"({est.total:.3g} bytes) per device, more than any memory ({format_bytes(MAX_BYTES)}); expected "
            "a --seq and --batch (and model dimensions) whose activations fit in memory"
        )
    if args.json:
        import json

        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(est)
    return 0
