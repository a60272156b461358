"""``python -m llmmem profile``: one training step of a named model (or a Hugging Face model built
from a config, random weights) under the :class:`~llmmem.diagnostics.tracker.MemoryTracker`; prints
the tracker's table beside the estimator's prediction and writes the timeline picture.

    python -m llmmem profile --model gpt2-small --batch 8 --seq 1024
    python -m llmmem profile --model gpt-tiny --hf llama --png llama.png --json llama.json
"""

from __future__ import annotations

import contextlib

from llmmem.estimation import model_configs

__all__ = ["register_cli", "SMALL_MODELS", "build_model"]

# Small configurations for trying the command (and for tests); the estimator's named models
# (gpt2, gpt2-medium, ..., llama-7b, ...) are also accepted, with "gpt2-small" meaning "gpt2".
SMALL_MODELS = {
    "gpt-tiny": dict(layers=2, hidden=64, heads=4, vocab=256, seq=64, dropout=0.1),
    "gpt-small": dict(layers=4, hidden=128, heads=4, vocab=512, seq=128, dropout=0.1),
}
_ALIASES = {"gpt2-small": "gpt2"}


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "profile",
        help="one training step under the memory tracker, beside the estimate",
        description="Runs training steps of a model under llmmem.MemoryTracker and prints where memory went "
        "(by category, phase and module) next to llmmem.estimate's prediction; writes a timeline PNG.",
    )
    names = ", ".join(list(SMALL_MODELS) + ["gpt2-small"] + list(model_configs.NAMED_MODELS))
    p.add_argument("--model", default="gpt-tiny", help=f"one of: {names} (default gpt-tiny)")
    p.add_argument(
        "--hf", choices=("llama", "gpt2"), default=None, help="build a Hugging Face model of these dimensions"
    )
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's, at most 1024)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
        p.add_argument(f"--{flag}", type=int, default=None, help=f"override the model's {flag}")
    p.add_argument("--dropout", type=float, default=None, help="override the dropout probability")
    p.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit", help="default explicit")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw", help="default adamw")
    p.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="fp32", help="bf16-mixed: autocast")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--steps", type=int, default=1, help="steps under the tracker (default 1)")
    p.add_argument("--warmup", type=int, default=0, help="steps before tracking (default 0)")
    p.add_argument("--top", type=int, default=10, help="modules in the table (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default="memory.png", help="timeline picture (default memory.png)")
    p.add_argument("--no-png", action="store_true", help="do not write the picture")
    p.add_argument("--json", default=None, help="also write every figure as JSON to this file")
    p.set_defaults(func=_run_cli)


def _dims(args) -> dict:
    key = _ALIASES.get(args.model.strip().lower(), args.model.strip().lower())
    if key in SMALL_MODELS:
        d = dict(SMALL_MODELS[key], name=key)
    elif key in model_configs.NAMED_MODELS:
        cfg = model_configs.NAMED_MODELS[key]
        d = dict(
            layers=cfg.layers,
            hidden=cfg.hidden,
            heads=cfg.heads,
            kv_heads=cfg.kv_heads,
            ffn=cfg.ffn,
            vocab=cfg.vocab,
            mlp=cfg.mlp,
            seq=min(cfg.max_positions or 1024, 1024),
            dropout=cfg.dropout,
            name=args.model,
        )
    else:
        names = ", ".join(list(SMALL_MODELS) + ["gpt2-small"] + list(model_configs.NAMED_MODELS))
        raise ValueError(f"--model: unknown model {args.model!r}; known: {names}")
    for flag in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "dropout"):
        value = getattr(args, flag)
        if value is not None:
            d[flag] = value
    if args.seq is not None:
        d["seq"] = args.seq
    for flag in ("layers", "hidden", "heads", "vocab", "seq"):
        if d[flag] <= 0:
            raise ValueError(f"--{flag}: must be a positive integer, got {d[flag]}")
    if d["hidden"] % d["heads"]:
        raise ValueError(f"--heads: {d['heads']} must divide --hidden {d['hidden']}")
    if not 0.0 <= d["dropout"] < 1.0:
        raise ValueError(f"--dropout: must be in [0, 1), got {d['dropout']}")
    for flag in ("batch", "steps", "top"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag}: must be a positive integer, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup: must be >= 0, got {args.warmup}")
    return d


def build_model(d: dict, hf: str | None, attention: str):
    """The model for dimensions ``d`` (see :data:`SMALL_MODELS`): llmmem's GPT, or a Hugging Face
    GPT-2 / Llama with random weights (never downloads)."""
    if hf is None:
        if d.get("mlp", "gelu") != "gelu":
            raise ValueError(
                f"--model {d['name']}: llmmem's GPT has a GELU MLP; use --hf llama for {d.get('mlp')} models"
            )
        from llmmem.models.gpt import GPT, GPTConfig

        cfg = GPTConfig(
            layers=d["layers"],
            hidden=d["hidden"],
            heads=d["heads"],
            seq_len=d["seq"],
            vocab_size=d["vocab"],
            ffn_hidden=d.get("ffn"),
            dropout=d["dropout"],
            attention=attention,
        )
        return GPT(cfg)
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(f"--hf {hf}: transformers is not installed ({exc})") from exc
    impl = "eager" if attention == "explicit" else "sdpa"
    special = dict(bos_token_id=min(1, d["vocab"] - 1), eos_token_id=min(2, d["vocab"] - 1), pad_token_id=0)
    if hf == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=d["vocab"],
            n_embd=d["hidden"],
            n_layer=d["layers"],
            n_head=d["heads"],
            n_inner=d.get("ffn"),
            n_positions=d["seq"],
            resid_pdrop=d["dropout"],
            embd_pdrop=d["dropout"],
            attn_pdrop=d["dropout"],
            attn_implementation=impl,
            **special,
        )
        return transformers.GPT2LMHeadModel(config)
    ffn = d.get("ffn")
    if ffn is None or d.get("mlp", "swiglu") == "gelu":
        ffn = 256 * -(-(8 * d["hidden"] // 3) // 256)  # LLaMA's rule
    config = transformers.LlamaConfig(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        intermediate_size=ffn,
        num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"],
        num_key_value_heads=d.get("kv_heads") or d["heads"],
        max_position_embeddings=d["seq"],
        attention_dropout=d["dropout"],
        attn_implementation=impl,
        **special,
    )
    return transformers.LlamaForCausalLM(config)


def _run_cli(args) -> int:
    import torch

    from llmmem.diagnostics.advice import estimate_settings
    from llmmem.diagnostics.tracker import MemoryTracker
    from llmmem.estimation import estimate
    from llmmem.units import format_bytes

    d = _dims(args)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise ValueError(f"--device: expected cpu or cuda[:N], got {args.device!r}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    torch.manual_seed(args.seed)
    model = build_model(d, args.hf, args.attention).to(device)
    model.train()
    opt_cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[args.optimizer]
    opt = opt_cls(model.parameters(), lr=1e-4)
    batch, seq, vocab = args.batch, d["seq"], d["vocab"]

    def autocast():
        if args.precision == "bf16-mixed":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step():
        idx = torch.randint(0, vocab, (batch, seq), device=device)
        with autocast():
            if args.hf:
                loss = model(input_ids=idx, labels=idx).loss
            else:
                _, loss = model(idx, targets=idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    with MemoryTracker(model, opt) as tracker:
        for _ in range(args.steps):
            step()
    kind = f"Hugging Face {args.hf}" if args.hf else "llmmem GPT"
    print(
        f"{d['name']} ({kind}: {d['layers']} layers, hidden {d['hidden']}, {d['heads']} heads, vocab {d['vocab']}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters), batch {batch} x seq {seq}, {args.precision}, "
        f"{args.optimizer}, {args.steps} step(s) tracked after {args.warmup} warm-up"
    )
    print()
    print(tracker.table(top=args.top))
    settings = estimate_settings(
        model,
        batch=batch,
        seq=seq,
        optimizer=opt,
        autocast_dtype=torch.bfloat16 if args.precision == "bf16-mixed" else None,
        device=str(device),
    )
    comparison, est = [], None
    try:
        est = estimate(model, **settings)
    except ValueError as exc:
        print(f"\nno estimate for this model: {exc}")
    if est is not None:
        xs, ys = tracker.timeline()
        most = {c: max(v) if v else 0 for c, v in ys.items()}
        eof = tracker.end_of_forward() or {}
        now = tracker.current()
        rows = [
            ("parameters + buffers", now["parameters"] + now["buffers"], est.parameters + est.master_weights),
            ("gradients (most at once)", most["gradients"], est.gradients),
            ("optimizer state", most["optimizer_state"], est.optimizer_state),
            (
                "model state (the three above)",
                now["parameters"] + now["buffers"] + most["gradients"] + most["optimizer_state"],
                est.parameters + est.master_weights + est.gradients + est.optimizer_state,
            ),
            ("activations kept at backward start", eof.get("activations", 0), est.activations),
            ("peak (estimate: all terms at once)", tracker.peak_bytes(), est.total),
        ]
        call = ", ".join(f"{k}={v}" for k, v in settings.items())
        print(f"\nmeasured vs llmmem.estimate(model, {call})")
        print(f"  {'':<38}{'measured':>14}{'estimate':>14}{'ratio':>9}")
        for label, m, e in rows:
            ratio = f"{m / e:.3f}" if e else "-"
            print(f"  {label:<38}{format_bytes(m):>14}{format_bytes(e):>14}{ratio:>9}")
            comparison.append({"what": label, "measured": m, "estimate": e})
        if args.precision == "bf16-mixed":
            print(
                "  (torch.autocast keeps fp32 parameters and gradients; the estimator's bf16-mixed splits the same "
                "16 B/param with Adam as 2 + 2 + 4 master + 8: compare the model state total)"
            )
    if not args.no_png:
        tracker.plot(args.png, title=f"{d['name']} ({kind}), batch {batch} x seq {seq}: memory on {tracker.device}")
        print(f"\nwrote {args.png}")
    if args.json:
        import json

        data = {
            "model": d,
            "hf": args.hf,
            "settings": settings,
            "tracker": tracker.to_dict(),
            "estimate": est.to_dict() if est is not None else None,
            "comparison": comparison,
        }
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0
