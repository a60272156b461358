"""``python -m llmmem profile``: one training step of a named model (or a Hugging Face model built
from a config, random weights) under the :class:`~llmmem.diagnostics.tracker.MemoryTracker`; prints
the tracker's table beside the estimator's prediction and writes the timeline picture.

Before any memory is taken ``llmmem.estimate`` predicts the step's peak from the model's config: a
run predicted to need more than the device (or the host) can still give is refused with that figure
(``--force`` runs it anyway), instead of being killed by the kernel.

    python -m llmmem profile --model gpt2-small --batch 8 --seq 1024
    python -m llmmem profile --model gpt-tiny --hf llama --png llama.png --json llama.json
"""

from __future__ import annotations

import contextlib
import sys

from llmmem.estimation import model_configs
from llmmem.paths import check_output_file

__all__ = ["register_cli", "SMALL_MODELS", "build_model", "build_config", "model_from_config"]

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
    p.add_argument(
        "--force",
        action="store_true",
        help="run even when llmmem.estimate predicts more memory than the device (or host) can still give",
    )
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
    mha = d.get("kv_heads") in (None, d["heads"])  # the named model's key/value heads follow its heads
    for flag in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "dropout"):
        value = getattr(args, flag)
        if value is not None:
            d[flag] = value
    if args.kv_heads is None and mha:
        d["kv_heads"] = None
    if args.seq is not None:
        d["seq"] = args.seq
    for flag in ("layers", "hidden", "heads", "vocab", "seq"):
        if d[flag] <= 0:
            raise ValueError(f"--{flag}: must be a positive integer, got {d[flag]}")
    if d.get("ffn") is not None and d["ffn"] <= 0:
        raise ValueError(f"--ffn: must be a positive integer, got {d['ffn']}")
    if d["hidden"] % d["heads"]:
        raise ValueError(f"--heads: {d['heads']} must divide --hidden {d['hidden']}")
    kv = d.get("kv_heads")
    if kv is not None:
        given = f"--kv-heads {kv}" if args.kv_heads is not None else f"{d['name']}'s key/value heads ({kv})"
        if kv <= 0:
            raise ValueError(f"--kv-heads: must be a positive integer, got {kv}")
        if d["heads"] % kv:
            raise ValueError(f"{given} must divide --heads {d['heads']} (grouped-query attention)")
        if kv != d["heads"] and args.hf != "llama":
            model = f"Hugging Face {args.hf}" if args.hf else "llmmem's GPT"
            raise ValueError(
                f"{given}: {model} has one key/value head per attention head; grouped key/value heads need --hf llama"
            )
    if not 0.0 <= d["dropout"] < 1.0:
        raise ValueError(f"--dropout: must be in [0, 1), got {d['dropout']}")
    for flag in ("batch", "steps", "top"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag}: must be a positive integer, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup: must be >= 0, got {args.warmup}")
    if not -(2**63) <= args.seed < 2**64:  # what torch.manual_seed takes
        raise ValueError(f"--seed: must be in [-2**63, 2**64), got {args.seed}")
    return d


def build_model(d: dict, hf: str | None, attention: str):
    """The model for dimensions ``d`` (see :data:`SMALL_MODELS`): llmmem's GPT, or a Hugging Face
    GPT-2 / Llama with random weights (never downloads)."""
    return model_from_config(build_config(d, hf, attention))


def model_from_config(config):
    """The model of a :func:`build_config` result, on torch's default device (``with torch.device``)."""
    from llmmem.models.gpt import GPT, GPTConfig

    if isinstance(config, GPTConfig):
        return GPT(config)
    import transformers

    if isinstance(config, transformers.GPT2Config):
        return transformers.GPT2LMHeadModel(config)
    return transformers.LlamaForCausalLM(config)


def build_config(d: dict, hf: str | None, attention: str):
    """The config of :func:`build_model`'s model (llmmem's ``GPTConfig``, a Hugging Face config):
    enough for ``llmmem.estimate`` to size the run before any memory is taken."""
    if hf is None:
        if d.get("mlp", "gelu") != "gelu":
            raise ValueError(
                f"--model {d['name']}: llmmem's GPT has a GELU MLP; use --hf llama for {d.get('mlp')} models"
            )
        from llmmem.models.gpt import GPTConfig

        return GPTConfig(
            layers=d["layers"],
            hidden=d["hidden"],
            heads=d["heads"],
            seq_len=d["seq"],
            vocab_size=d["vocab"],
            ffn_hidden=d.get("ffn"),
            dropout=d["dropout"],
            attention=attention,
        )
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
        return config
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
    return config


def _device(torch, text: str):
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device: expected cpu or cuda[:N], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda[:N], got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: no CUDA device is available")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def _check_outputs(args) -> None:
    """Every file the run will write, checked before it starts (a step can take minutes)."""
    if not args.no_png:
        check_output_file(args.png, "--png")
        if not args.png.lower().endswith(".png"):
            # matplotlib picks the format from the suffix, and adds ".png" to a name without one
            raise ValueError(f"--png: expected a file name ending in .png, got {args.png!r}")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                "--png: the picture needs matplotlib (pip install matplotlib), or pass --no-png"
            ) from None
    if args.json is not None:
        check_output_file(args.json, "--json")


def _capacity(device) -> tuple[int | None, str]:
    """(bytes this process can still allocate on ``device`` or None when unknown, where from)."""
    if device.type == "cuda":
        from llmmem.diagnostics.oom import cuda_capacity

        return cuda_capacity(str(device))
    from llmmem.pool import host_memory

    try:
        host = host_memory()
    except ImportError as exc:  # no C core: no figure to check against
        return None, f"host memory unknown ({exc})"
    return host["available"], f"host memory this process can still get ({host['bound']})"


def _check_fits(est, device, args, format_bytes) -> int:
    """Prints the predicted peak; refuses (ValueError) when it exceeds what ``device`` can still
    give, unless ``--force``. Returns the prediction (bytes)."""
    predicted = est.total
    state = est.parameters + est.master_weights + est.gradients + est.optimizer_state
    print(
        f"llmmem.estimate predicts a peak of {format_bytes(predicted)} on {device} (model state "
        f"{format_bytes(state)}, activations {format_bytes(est.activations)}, largest temporary "
        f"{format_bytes(est.temporary)})"
    )
    capacity, source = _capacity(device)
    if capacity is None:
        print(f"  (not checked against the memory available: {source})")
    elif predicted > capacity:
        if state > capacity:
            hint = "the model's state alone does not fit: pick a smaller --model or fewer --layers"
        else:
            hint = "lower --batch or --seq" + (", use --attention sdpa" if args.attention == "explicit" else "")
        message = (
            f"llmmem.estimate predicts a peak of {format_bytes(predicted)} for batch {args.batch} x seq "
            f"{est.settings.seq} ({args.attention} attention), more than the {format_bytes(capacity)} of {source}; "
            f"{hint}, or pass --force to run it anyway"
        )
        if not args.force:
            raise ValueError(message)
        print(f"  --force: running although {message.split('; ')[0]}")
    else:
        print(f"  within the {format_bytes(capacity)} of {source}")
    return predicted


def _run_cli(args) -> int:
    import torch

    from llmmem.diagnostics.advice import estimate_settings
    from llmmem.diagnostics.tracker import MemoryTracker, is_out_of_memory
    from llmmem.estimation import estimate
    from llmmem.units import format_bytes

    d = _dims(args)
    device = _device(torch, args.device)
    _check_outputs(args)
    opt_cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[args.optimizer]
    batch, seq, vocab = args.batch, d["seq"], d["vocab"]
    autocast_dtype = torch.bfloat16 if args.precision == "bf16-mixed" else None
    # The prediction comes before any memory is taken, from the config alone (building even a
    # meta-device model of a huge config takes minutes and gigabytes of Python objects), so a setting
    # that cannot fit is refused instead of killed by the OOM killer.
    config = build_config(d, args.hf, args.attention)
    settings = estimate_settings(
        config,
        batch=batch,
        seq=seq,
        optimizer=opt_cls([torch.nn.Parameter(torch.empty(0, device="meta"))], lr=1e-4),  # its kind only
        autocast_dtype=autocast_dtype,
        device=str(device),
    )
    est, predicted = None, None
    try:
        est = estimate(config, **settings)
    except ValueError as exc:
        print(f"no estimate for this model: {exc}")
    if est is not None:
        predicted = _check_fits(est, device, args, format_bytes)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = model_from_config(config)
    model.train()
    opt = opt_cls(model.parameters(), lr=1e-4)

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

    try:
        for _ in range(args.warmup):
            step()
        with MemoryTracker(model, opt) as tracker:
            for _ in range(args.steps):
                step()
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        guess = "" if predicted is None else f" (llmmem.estimate predicted a peak of {format_bytes(predicted)})"
        print(f"error: out of memory in the training step{guess}: {first}", file=sys.stderr)
        return 1
    kind = f"Hugging Face {args.hf}" if args.hf else "llmmem GPT"
    print(
        f"{d['name']} ({kind}: {d['layers']} layers, hidden {d['hidden']}, {d['heads']} heads, vocab {d['vocab']}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters), batch {batch} x seq {seq}, {args.precision}, "
        f"{args.optimizer}, {args.steps} step(s) tracked after {args.warmup} warm-up"
    )
    print()
    print(tracker.table(top=args.top))
    comparison = []
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
        title = f"{d['name']} ({kind}), batch {batch} x seq {seq}: memory on {tracker.device}"
        try:
            tracker.plot(args.png, title=title)
        except OSError as exc:  # checked at the start; the folder can still go away during the run
            raise ValueError(f"--png: cannot write {args.png}: {exc.strerror or exc}") from None
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
        try:
            with open(args.json, "w") as fh:
                json.dump(data, fh, indent=1, default=str)
        except OSError as exc:
            raise ValueError(f"--json: cannot write {args.json}: {exc.strerror or exc}") from None
        print(f"wrote {args.json}")
    return 0
