"""Train a GPT with llmmem's memory techniques: the reference training script to copy.

One flag per technique; they combine. CPU by default, CUDA when present.

    python examples/train_gpt.py                                          # fp32, no checkpointing
    python examples/train_gpt.py --checkpoint every --amp bf16            # recompute every block, bf16 autocast
    python examples/train_gpt.py --checkpoint auto --budget 0.5           # the planner: half the activation memory
    python examples/train_gpt.py --checkpoint auto --budget 64MB --offload
    python examples/train_gpt.py --amp fp16                               # fp16 autocast + llmmem.GradScaler
    python examples/train_gpt.py --optim adamw-int8 --bf16-weights --step-in-backward   # the model state lean
    python examples/train_gpt.py --model hf-llama --checkpoint every      # a Hugging Face Llama (random weights)
    python examples/train_gpt.py --model hf-llama --fused-head            # its loss without the [tokens x vocab] logits
    python examples/train_gpt.py --steps 200 --save ckpt --save-every 50  # then: --resume ckpt
    torchrun --nproc-per-node 2 examples/train_gpt.py --tp 2 --sequence-parallel
    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --sequence-parallel   # TP 2 x DP 2 with ZeRO-1
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_gpt.py --device cuda --tp 8 --sequence-parallel --amp bf16 --checkpoint every

``--optim``, ``--bf16-weights`` and ``--step-in-backward`` shrink the model state (what a full
fine-tune's memory is made of): Adam's moments in bf16, 8 or 4 bits (``llmmem.optim.AdamW``),
parameters in bf16 with no fp32 master (updated with stochastic rounding), and each parameter
updated as soon as its gradient exists, so no step holds every gradient.

``--fused-head`` patches the model with ``llmmem.patch_lm_loss``: the loss comes from the last hidden
states and the head's weight in chunks of rows, and the [tokens x vocabulary] logits (with their
gradient) never exist whole, the largest activation of a model with a large vocabulary.

``--batch`` is the global batch of one optimizer step: it is split over the data-parallel ranks and
then into ``--grad-accum`` micro-batches, so the losses do not depend on how many ranks train.
The model is the GPT of ``llmmem/models/gpt.py`` trained on bytes (a vocabulary of 256) of a text
file, by default ``examples/data/corpus.txt`` (generated prose; any UTF-8 file works). Checkpoints
are sets, one step on every rank or none, checked by digest on resume: ``train_gpt_checkpoints.py``
beside this file (copy both).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

import llmmem
import llmmem.optim
from llmmem.compare.corpus import VOCAB_SIZE, BatchSampler, encode
from llmmem.dtensors import is_dtensor
from llmmem.dtensors import local as local_shard
from llmmem.models.gpt import GPT, GPTConfig

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script it is there already; imported by path, not
    sys.path.append(str(HERE))
import train_gpt_checkpoints as checkpoints  # noqa: E402  (the checkpoint sets, a file beside this one)

DEFAULT_DATA = HERE / "data" / "corpus.txt"
# --optim -> the moments' format of llmmem.optim.AdamW ("adamw" alone is torch.optim.AdamW)
STATE_DTYPES = {"adamw": "fp32", "adamw-bf16": "bf16", "adamw-int8": "int8", "adamw-int4": "int4"}


# ------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a GPT with llmmem's memory techniques.",
        epilog="Under torchrun: --tp N tensor-parallel ranks; the other ranks are data-parallel replicas.",
    )
    m = p.add_argument_group("model and data")
    m.add_argument("--model", choices=["gpt", "hf-llama"], default="gpt", help="hf-llama needs transformers")
    m.add_argument("--layers", type=_positive, default=8)
    m.add_argument("--hidden", type=_positive, default=128)
    m.add_argument("--heads", type=_positive, default=4)
    m.add_argument("--seq-len", type=_positive, default=256)
    m.add_argument("--dropout", type=float, default=0.1)
    m.add_argument("--attention", choices=["explicit", "sdpa"], default="explicit", help="gpt only")
    m.add_argument("--data", type=pathlib.Path, default=DEFAULT_DATA, help="a text file, read as bytes")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=_positive, default=50, help="optimizer steps in all (a resumed run continues)")
    t.add_argument("--batch", type=_positive, default=8, help="global batch per optimizer step (sequences)")
    t.add_argument("--grad-accum", type=_positive, default=1, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=_positive_float, default=3e-3, help="AdamW's learning rate (default 3e-3)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda when present")
    t.add_argument("--threads", type=_positive, default=None, help="torch CPU threads")
    mem = p.add_argument_group("memory techniques")
    mem.add_argument(
        "--checkpoint",
        choices=["none", "every", "selective", "auto"],
        default="none",
        help="activation checkpointing: every block, every block keeping its matmuls (selective), or the "
        "llmmem planner for --budget (auto)",
    )
    mem.add_argument(
        "--budget",
        type=_budget,
        default=None,
        help="with --checkpoint auto: the step's activation peak, in bytes ('64MB') or as a fraction (0.5) or "
        "percent ('50%%') of it without checkpointing",
    )
    mem.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none", help="fp16 uses llmmem.GradScaler")
    mem.add_argument(
        "--optim",
        choices=list(STATE_DTYPES),
        default="adamw",
        help="adamw: torch.optim.AdamW (fp32 moments, 8 B a parameter); adamw-bf16, adamw-int8, adamw-int4: "
        "llmmem.optim.AdamW with its moments in bf16 (4 B), 8 bits (2 B) or 4 bits (1 B). A resumed run may "
        "switch: the saved moments are converted",
    )
    mem.add_argument(
        "--bf16-weights",
        action="store_true",
        help="parameters (and gradients) in bf16 with no fp32 master copy, updated by llmmem.optim.AdamW with "
        "stochastic rounding (with --optim adamw: llmmem's AdamW with fp32 moments)",
    )
    mem.add_argument(
        "--step-in-backward",
        action="store_true",
        help="update each parameter as soon as its gradient exists and free the gradient "
        "(llmmem.optim.step_in_backward): no moment of a step holds every gradient",
    )
    mem.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="keep the optimizer's moments (and masters) in host memory and step them there with "
        "llmmem.optim.AdamW(offload='cpu'); on the CPU it only adds copies",
    )
    mem.add_argument(
        "--fused-head",
        action="store_true",
        help="the LM head's loss without the [tokens x vocab] logits (llmmem.patch_lm_loss; one device: no --tp)",
    )
    mem.add_argument("--offload", action="store_true", help="keep checkpointed block inputs in host memory (CUDA)")
    mem.add_argument("--pool", action="store_true", help="allocate CUDA memory from an llmmem.MemoryPool")
    par = p.add_argument_group("parallelism (under torchrun)")
    par.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size (divides the world size)")
    par.add_argument("--sequence-parallel", action="store_true", help="with --tp > 1: split the sequence too")
    par.add_argument(
        "--zero",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ZeRO-1 over the data-parallel ranks (torch's ZeroRedundancyOptimizer); default on",
    )
    par.add_argument(
        "--fsdp",
        choices=["none", "zero2", "zero3"],
        default="none",
        help="shard parameters, gradients and optimizer state over the data-parallel ranks with torch's FSDP2 "
        "(fully_shard, each block and the whole model): zero2 keeps a block's parameters gathered from its "
        "forward to its backward, zero3 frees them after the forward and gathers them again in backward. "
        "Replaces DistributedDataParallel and --zero; with --tp, the second dimension of a 2-D layout",
    )
    io = p.add_argument_group("checkpoints and output")
    io.add_argument("--save", type=pathlib.Path, default=None, help="folder to save the training state in")
    io.add_argument("--save-every", type=_positive, default=None, help="save every N steps (and at the end)")
    io.add_argument("--keep", type=_positive, default=2, help="complete checkpoint sets kept (default 2)")
    io.add_argument(
        "--resume",
        type=pathlib.Path,
        default=None,
        help="a --save folder (its newest complete set) or one step-N set in it; flags given with it apply",
    )
    io.add_argument("--log-json", type=pathlib.Path, default=None, help="write the losses of every step (rank 0)")
    io.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    # the flags on the command line, told from defaults: a resume applies these over the saved state
    unset = object()
    given = p.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args), unset)))
    args.given = sorted(k for k, v in vars(given).items() if v is not unset)
    _check(p, args)
    return args


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0.0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _budget(text: str):
    from llmmem.checkpointing import parse_budget

    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None:  # 0.5 is a fraction, 67108864 bytes
        text = int(number) if number > 1.0 and number.is_integer() else number
    try:
        return parse_budget(text, "--budget")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--budget: budget ")) from None


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Combinations argparse cannot see: each is a usage error, before anything is built."""
    world = _world()
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device (install a CUDA build of torch, or use --device cpu)")
    if not 0.0 <= a.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {a.dropout}")
    if a.budget is not None and a.checkpoint != "auto":
        p.error("--budget goes with --checkpoint auto")
    if a.checkpoint == "auto" and a.budget is None:
        a.budget = 0.5
    if a.offload and a.checkpoint == "none":
        p.error(
            "--offload keeps the inputs of checkpointed blocks in host memory: add --checkpoint every|selective|auto"
        )
    if a.pool and not cuda:
        p.error("--pool allocates CUDA memory from an llmmem.MemoryPool: it needs a CUDA device (--device cuda)")
    if a.hidden % a.heads:
        p.error(f"--heads ({a.heads}) must divide --hidden ({a.hidden})")
    if a.tp > 1 and world == 1:
        p.error(f"--tp {a.tp} needs {a.tp} processes: torchrun --nproc-per-node {a.tp} {sys.argv[0]} --tp {a.tp} ...")
    if world % a.tp:
        p.error(f"--tp {a.tp} must divide the number of processes ({world})")
    if a.sequence_parallel and a.tp == 1:
        p.error("--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs --tp > 1")
    if a.sequence_parallel and a.seq_len % a.tp:
        p.error(f"--sequence-parallel: --seq-len ({a.seq_len}) must be divisible by --tp ({a.tp})")
    if a.model == "hf-llama" and a.tp > 1:
        p.error(
            "--tp applies to --model gpt (llmmem.parallel.TensorParallelGPT); here hf-llama trains data-parallel "
            "only (in your own script, llmmem.parallel.parallelize(model, group) splits a Hugging Face Llama)"
        )
    if a.tp > 1 and (a.heads % a.tp or (4 * a.hidden) % a.tp or VOCAB_SIZE % a.tp):
        p.error(f"--tp {a.tp} must divide --heads ({a.heads}), 4 x --hidden and the vocabulary ({VOCAB_SIZE})")
    if a.tp > 1 and a.fused_head:
        p.error("--fused-head patches a one-device model (llmmem.patch_lm_loss); with --tp the loss is split already")
    if a.tp > 1 and a.checkpoint == "auto":
        p.error("--checkpoint auto plans single-device blocks; with --tp use --checkpoint every or selective")
    dp = world // a.tp
    if a.fsdp != "none":
        if dp == 1:
            p.error(
                f"--fsdp {a.fsdp} shards over the data-parallel ranks, and this run has one: run more processes "
                f"than --tp ({a.tp}), e.g. torchrun --nproc-per-node {2 * a.tp} {sys.argv[0]} --fsdp {a.fsdp} ..."
            )
        if "zero" in a.given and a.zero:
            p.error(f"--zero shards the optimizer state with ZeRO-1; --fsdp {a.fsdp} shards it already: drop --zero")
        if a.sequence_parallel:
            p.error(
                f"--sequence-parallel with --fsdp {a.fsdp}: FSDP2 replaces the parameters, and the norms' "
                "gradients that sequence parallelism sums over the tensor-parallel ranks lose their mark"
            )
        if a.offload_optimizer:
            p.error(f"--offload-optimizer with --fsdp {a.fsdp}: the optimizer's host copies are not sharded")
    if a.bf16_weights and a.amp == "fp16":
        p.error(
            "--bf16-weights trains in bf16: fp16 autocast (--amp fp16) would cast every matmul to fp16; use --amp bf16"
        )
    if a.step_in_backward:
        # each refusal names the conflict: a step in backward updates a parameter, and frees its
        # gradient, as soon as the gradient exists
        if a.grad_accum > 1:
            p.error(
                f"--step-in-backward updates the weights during every backward: gradient accumulation "
                f"(--grad-accum {a.grad_accum}) would apply each micro-batch as an update of its own"
            )
        if a.amp == "fp16":
            p.error(
                "--step-in-backward with --amp fp16: the loss scaler must find inf/NaN in every gradient before any "
                "parameter is updated; use --amp bf16 (no scaler)"
            )
        if a.sequence_parallel:
            p.error(
                "--step-in-backward with --sequence-parallel: the norms' gradients are summed over the "
                "tensor-parallel ranks after backward, when they have been stepped and freed already"
            )
        if dp > 1:
            p.error(
                f"--step-in-backward with {dp} data-parallel ranks: each parameter would be stepped on its rank's "
                "own gradient, before DistributedDataParallel averages it over the ranks (and ZeRO-1 needs "
                f"a step of its own); run one data-parallel rank (--tp {world})"
            )
    if a.batch % (dp * a.grad_accum):
        p.error(f"--batch ({a.batch}) must be divisible by data-parallel ranks ({dp}) x --grad-accum ({a.grad_accum})")
    if a.save_every is not None and a.save is None:
        p.error("--save-every needs --save FOLDER")
    if a.resume is not None and not a.resume.is_dir():
        p.error(f"--resume {a.resume}: no such folder")
    if a.save is not None and a.save.exists() and not a.save.is_dir():
        p.error(f"--save {a.save}: exists and is not a folder")
    if not a.data.is_file():
        p.error(f"--data {a.data}: no such file")
    # before the model is built: its causal mask alone is seq_len^2 bytes
    if a.data.stat().st_size < a.seq_len + 2:
        p.error(f"--data {a.data}: {a.data.stat().st_size} bytes, fewer than --seq-len ({a.seq_len}) + 2")
    if a.model == "hf-llama":
        try:
            import transformers  # noqa: F401
        except ImportError:
            p.error("--model hf-llama needs Hugging Face transformers: pip install transformers")


# ------------------------------------------------------------------------------------------------
# Distributed set-up


class Dist:
    """This process's place: tensor-parallel and data-parallel ranks and groups (all 1 without torchrun)."""

    def __init__(self, args) -> None:
        self.world = _world()
        self.rank = int(os.environ.get("RANK", "0"))
        self.tp, self.dp = args.tp, self.world // args.tp
        self.tp_group = self.dp_group = None
        self.tp_rank = self.dp_rank = 0
        self.owns_process_group = False
        if self.world > 1:
            import torch.distributed as dist

            import llmmem.parallel as tp

            backend = "nccl" if args.device_obj.type == "cuda" else "gloo"
            self.owns_process_group = not dist.is_initialized()  # else the caller made it, and ends it
            tp.init(tensor_parallel_size=args.tp, backend=backend)
            self.tp_group, self.dp_group = tp.get_tensor_parallel_group(), tp.get_data_parallel_group()
            self.tp_rank, self.dp_rank = dist.get_rank(self.tp_group), dist.get_rank(self.dp_group)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def all_gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def mean_over_dp(self, value: float) -> float:
        if self.dp == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device="cpu" if dist.get_backend() == "gloo" else "cuda")
        dist.all_reduce(t, group=self.dp_group)
        return float(t) / self.dp


def pick_device(args) -> torch.device:
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------------
# Model and memory techniques


def build_model(args, device, d: Dist):
    """(model to call, inner model whose parameters train, list of its blocks)."""
    torch.manual_seed(args.seed)  # the same weights on every rank: TP ranks keep their slices
    if args.model == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=args.hidden,
            intermediate_size=(8 * args.hidden // 3 + 63) // 64 * 64,  # SwiGLU's 8/3 h, rounded to 64
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=max(1, args.heads // 2),
            max_position_embeddings=args.seq_len,
            attention_dropout=args.dropout,
            use_cache=False,
        )
        model = LlamaForCausalLM(cfg).to(device)
        if args.bf16_weights:
            model.to(torch.bfloat16)
        return model, model, list(model.model.layers)
    cfg = GPTConfig(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq_len=args.seq_len,
        vocab_size=VOCAB_SIZE,
        dropout=args.dropout,
        attention=args.attention,
    )
    model = GPT(cfg).to(device)
    if args.tp > 1:
        import llmmem.parallel as tp

        tp.model_parallel_manual_seed(args.seed)  # dropout streams of the split attention heads
        model = tp.TensorParallelGPT.from_gpt(model, process_group=d.tp_group)
        if args.sequence_parallel:
            model = tp.SequenceParallelGPT(model)
    if args.bf16_weights:
        model.to(torch.bfloat16)  # no fp32 copy is kept anywhere: llmmem.optim.AdamW rounds stochastically
    return model, model, list(model.blocks)


def checkpoint_blocks(blocks, mode: str, offload: bool) -> None:
    """Recompute every block in backward (``llmmem.checkpoint``), in place: an instance-level
    ``forward``, so parameters and ``state_dict`` keys do not change."""
    options = {"offload": offload, "use_reentrant": False}
    if mode == "selective":
        options["context_fn"] = llmmem.selective_context_fn  # keep matmul outputs, recompute the rest
    for block in blocks:
        inner = type(block).forward.__get__(block)
        block.forward = functools.partial(llmmem.checkpoint, inner, **options)


def plan_checkpointing(args, model, sample_x, sample_y) -> str:
    """``--checkpoint auto``: the llmmem planner picks, per block, what to keep and what to recompute
    so that the step's activation peak fits ``--budget``, and runs the plan in place (the model's own
    forward and ``state_dict`` are unchanged). Exits with the smallest feasible budget when none fits."""

    def sample_step():  # one forward and backward on a batch of the training shape
        loss_of(args, model, sample_x, sample_y).backward()

    with amp_context(args):  # the blocks are profiled in the precision they train in
        try:
            plan = llmmem.auto_checkpoint(model, budget=args.budget, sample=sample_step, offload=args.offload)
        except llmmem.InfeasibleError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    model.zero_grad(set_to_none=True)  # the sample step's gradients are not the training's
    return plan.describe()


def shard_model(args, model, blocks, d: Dist) -> None:
    """``--fsdp``: torch's FSDP2 over the data-parallel ranks, applied after the tensor-parallel split
    and the checkpointing (torchtitan's order), each block a unit of its own so that one block's
    parameters at a time are gathered. The root keeps its parameters after the forward: backward
    starts with them."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(d.dp_group, args.device_obj.type)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=args.fsdp == "zero3")
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


def local_state(tree):
    """``tree`` (a state dict, nested) with each DTensor replaced by this rank's shard of it: what a
    rank saves under --fsdp, and the shapes its file is checked against (a run resumes on the
    same layout only)."""
    if is_dtensor(tree):
        return local_shard(tree)
    if isinstance(tree, dict):
        return {k: local_state(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_state(v) for v in tree)
    return tree


def local_bytes(tree) -> int:
    """Bytes of the tensors in ``tree`` (an iterable or nested state) held by this rank."""
    if tree is None:
        return 0
    if torch.is_tensor(tree):
        shard = local_shard(tree)
        return shard.numel() * shard.element_size()
    if isinstance(tree, dict):
        tree = tree.values()
    if isinstance(tree, (str, bytes)) or not hasattr(tree, "__iter__"):
        return 0
    return sum(local_bytes(v) for v in tree)


def load_model_state(model, saved: dict) -> None:
    """``saved`` into ``model``: ``load_state_dict``, or under --fsdp each rank's shards copied into
    its parameters' and buffers' own."""
    current = model.state_dict()
    if not any(is_dtensor(v) for v in current.values()):
        model.load_state_dict(saved)
        return
    with torch.no_grad():
        for key, value in current.items():
            local_shard(value).copy_(saved[key])


def shard_optimizer_state(optimizer) -> None:
    """After ``load_state_dict`` of a state saved as local shards (--fsdp): each moment that came
    back a plain tensor of its DTensor parameter's local shape becomes a DTensor laid out as the
    parameter again (the optimizer's step mixes the two otherwise)."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for param in group["params"]:
            if not is_dtensor(param):
                continue
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if torch.is_tensor(value) and not is_dtensor(value) and value.shape == param.to_local().shape:
                    state[key] = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )


def amp_context(args):
    if args.amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if args.amp == "bf16" else torch.float16
    return torch.autocast(args.device_obj.type, dtype=dtype)


def loss_of(args, model, x, y):
    with amp_context(args):
        if args.model == "hf-llama" and args.fused_head:
            # y is x shifted already: shift_labels says so (labels only has to be given); no logits are made
            return model(input_ids=x, labels=y, shift_labels=y, use_cache=False).loss
        if args.model == "hf-llama":
            logits = model(input_ids=x, use_cache=False).logits
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        if args.bf16_weights and args.tp == 1 and not args.fused_head:
            # bf16 logits, the loss taken on them in fp32: a bf16 loss keeps 3 significant digits
            # (the tensor-parallel loss is computed in fp32 already)
            logits, _ = model(x)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        _, loss = model(x, y)
        return loss


def gradient_sync(args, model, d: Dist, last: bool):
    """Gradient accumulation's micro-batches before the last one keep their gradients local: DDP's
    ``no_sync``, FSDP2's switch (its reduce-scatter waits for the last micro-batch)."""
    if args.fsdp != "none":
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return model.no_sync() if (d.dp > 1 and not last) else contextlib.nullcontext()


def agree_on_overflow(params, group) -> None:
    """fp16 with tensor parallelism: each rank's scaler checks only its own gradient shards, so a
    rank that sees an inf or NaN would skip the step while the others take it. Make every rank see
    it (poison one local gradient) so that all skip together. One all-reduce of one number."""
    import torch.distributed as dist

    # under --fsdp the gradients are DTensors: each rank checks, and poisons, its own shard
    grads = [local_shard(p.grad) for p in params if p.grad is not None]
    grads = [g for g in grads if g.numel()]
    bad = torch.zeros(1, device=grads[0].device if grads else "cpu" if dist.get_backend(group) == "gloo" else "cuda")
    for g in grads:
        if not torch.isfinite(g).all():
            bad.fill_(1.0)
            break
    local = bool(bad.item())
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bad.item() and not local and grads:
        grads[0].view(-1)[0] = float("inf")


def make_optimizer(args, model, d: Dist):
    """AdamW over ``model``'s parameters: torch's (``--optim adamw``, fp32 weights) or llmmem's with
    its moments in ``STATE_DTYPES[--optim]`` (also for ``--bf16-weights``: torch's AdamW would round
    each bf16 update to nearest, and lose the updates smaller than half a bf16 step); in torch's
    ZeroRedundancyOptimizer over the data-parallel ranks with ZeRO-1."""
    kwargs = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    if args.optim == "adamw" and not args.bf16_weights and not args.offload_optimizer:
        cls = torch.optim.AdamW
    else:
        cls = llmmem.optim.AdamW
        # the stochastic rounding's seed: the same on the replicas of a shard (they must stay equal),
        # another on each tensor-parallel rank (its shards are other weights)
        kwargs.update(state_dtype=STATE_DTYPES[args.optim], seed=args.seed * 1_000_003 + d.tp_rank)
        if args.offload_optimizer:
            kwargs["offload"] = "cpu"
    if args.zero and d.dp > 1 and args.fsdp == "none":  # FSDP2's parameters are shards already
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, process_group=d.dp_group, **kwargs)
    return cls(model.parameters(), **kwargs)


# ------------------------------------------------------------------------------------------------
# Saving and resuming: model, optimizer, scaler, data order and every RNG, on every rank


def rng_state(device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    from llmmem.parallel import get_rng_tracker

    state["tracker"] = get_rng_tracker().get_states()
    return state


def set_rng_state(state: dict, device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    from llmmem.parallel import get_rng_tracker

    if state.get("tracker"):
        get_rng_tracker().set_states(state["tracker"])


def save(folder: pathlib.Path, step: int, model, optimizer, scaler, sampler, device, d: Dist, args) -> None:
    """The checkpoint set of ``step`` in ``folder`` (``train_gpt_checkpoints.py``): ``rank{r}.pt`` for
    every rank and a manifest of their digests, current only once every file is written. ZeRO's
    optimizer state is consolidated on data-parallel rank 0 of each tensor-parallel rank (a
    collective: every rank calls this) and saved in its file only."""
    zero = hasattr(optimizer, "consolidate_state_dict")
    if zero:
        optimizer.consolidate_state_dict(to=0)
    state = {
        "step": step,
        "model": local_state(model.state_dict()),
        "optimizer": local_state(optimizer.state_dict()) if (not zero or d.dp_rank == 0) else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "sampler": sampler.state_dict(),
        "rng": rng_state(device),
    }
    args_text = {k: str(v) for k, v in vars(args).items() if k not in ("given", "device_obj")}
    meta = {"world": d.world, "tp": d.tp, "dp": d.dp, "args": args_text}
    try:
        ahead = checkpoints.save_set(folder, step, state, rank=d.rank, gather=d.all_gather, meta=meta, keep=args.keep)
    except checkpoints.CheckpointError as exc:
        raise SystemExit(f"error: --save {folder}: {exc}") from None
    if ahead:
        print(
            f"note: --save {folder}: removed {', '.join(ahead)}: ahead of step {step}, an earlier run's",
            file=sys.stderr,
        )


# Flags that change the model's parameters: a saved state loads only into the same ones (their
# dtype included: --bf16-weights); a flag a run saved before it existed had its default.
MODEL_FLAGS = ("model", "layers", "hidden", "heads", "seq_len", "bf16_weights")
MODEL_FLAG_DEFAULTS = {"bf16_weights": "False"}
# Flags that say how long the run goes and where it writes, not how it trains: not reported on resume.
RUN_FLAGS = ("steps", "resume", "save", "save_every", "keep", "log_json", "no_progress")


def resume(source: pathlib.Path, model, optimizer, scaler, sampler, device, d: Dist, args):
    """Load the newest checkpoint set in ``source`` that every rank finds whole (a collective; damaged
    sets are skipped, on every rank alike), then apply the flags given on the command line over it.
    Returns ``(step, the set chosen, the flags that differ from the saved run's)``; a set that
    cannot be resumed is an ``error:`` line naming the file and what is wrong with it."""
    expected = local_state(model.state_dict())

    def check(folder, manifest):  # on every rank, before anything is loaded into the run
        refuse_another_run(folder, manifest, d, args)
        own_path = checkpoints.verified_file(folder, manifest, f"rank{d.rank}.pt")
        own = checkpoints.load_rank_state(own_path, manifest, expected, device)
        opt_path, opt_state = own_path, own["optimizer"]
        # saved with ZeRO: the consolidated optimizer state is in data-parallel rank 0's file (its
        # global rank is the tp rank), whether this run uses ZeRO or not
        if opt_state is None and d.rank != d.tp_rank:
            opt_path = checkpoints.verified_file(folder, manifest, f"rank{d.tp_rank}.pt")
            opt_state = checkpoints.load_rank_state(opt_path, manifest, expected, device)["optimizer"]
        checkpoints.check_optimizer_state(opt_path, opt_state, optimizer)
        return own, opt_state

    try:
        chosen = checkpoints.choose_set(source, gather=d.all_gather, check=check)
    except checkpoints.CheckpointError as exc:
        raise SystemExit(f"error: --resume {source}: {exc}" if d.rank == 0 else 1) from None
    state, opt_state = chosen.value
    error = None
    try:
        load_model_state(model, state["model"])
        load_optimizer_state(optimizer, opt_state)
        shard_optimizer_state(getattr(optimizer, "optim", optimizer))
        if scaler is not None and state["scaler"] is not None:  # saved without --amp fp16: a fresh scaler
            scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"], device)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        error = f"{chosen.path / f'rank{d.rank}.pt'}: does not load: {checkpoints.first_line(exc)}"
    errors = [e for e in d.all_gather(error) if e]  # every rank trains, or none
    if errors:
        raise SystemExit(f"error: --resume {source}: {errors[0]}" if d.rank == 0 else 1)
    return int(chosen.manifest["step"]), chosen, apply_flags(args, chosen.manifest["args"], optimizer)


# llmmem.optim.AdamW's group settings of its moments' format: a resumed run keeps its own
LLMMEM_FORMAT_KEYS = ("state_dtype", "block_size", "stochastic_rounding", "min_quantized_numel", "master_weights")


def load_optimizer_state(optimizer, saved: dict) -> None:
    """``saved`` (any --optim's state, with ZeRO or without) into ``optimizer``, its moments
    converted to this run's --optim.

    llmmem's AdamW converts what it loads itself (torch's fp32 moments are quantized, its own
    formats widened or narrowed). Torch's AdamW would read llmmem's 8- or 4-bit codes as numbers:
    those are widened to fp32 first (``full_precision_state_dict``). ZeRO copies each saved state
    and group setting into its rank's optimizer as they were saved, so the format settings are put
    back afterwards and llmmem's optimizer converts its own state by loading it again."""
    local = getattr(optimizer, "optim", optimizer)  # ZeRO: this rank's optimizer
    ours = isinstance(local, llmmem.optim.Adam)
    states = saved["state"].values()
    if not ours and any(isinstance(s, dict) and "state_dtype" in s for s in states):
        widen = llmmem.optim.AdamW([{"params": list(g["params"])} for g in optimizer.param_groups])
        widen.load_state_dict(saved)
        saved = widen.full_precision_state_dict()
        del widen
    kept = [{k: g[k] for k in LLMMEM_FORMAT_KEYS} for g in local.param_groups] if ours else None
    optimizer.load_state_dict(saved)
    if local is optimizer:
        return
    for groups in (optimizer.param_groups, local.param_groups):  # ZeRO syncs the first into the second
        for i, group in enumerate(groups):
            for key in LLMMEM_FORMAT_KEYS:
                if ours:
                    group[key] = kept[i][key]
                else:
                    group.pop(key, None)
    if ours:
        local.load_state_dict(local.state_dict())


def refuse_another_run(folder, manifest: dict, d: Dist, args) -> None:
    """A whole set that this run must not continue: another layout or model, a new --seed, no steps left."""
    Refused = checkpoints.Refused
    layout = (manifest.get("world"), manifest.get("tp"))
    if layout != (d.world, d.tp):
        raise Refused(f"{folder}: saved with world={layout[0]} tp={layout[1]}, running with world={d.world} tp={d.tp}")
    saved = manifest.get("args")
    if not isinstance(saved, dict):
        raise checkpoints.Damaged(f"{folder / checkpoints.MANIFEST}: holds no flags of the saved run")
    saved_model = {k: saved.get(k, MODEL_FLAG_DEFAULTS.get(k)) for k in MODEL_FLAGS}
    changed = [
        f"--{k.replace('_', '-')} {saved_model[k]} (now {getattr(args, k)})"
        for k in MODEL_FLAGS
        if saved_model[k] is not None and saved_model[k] != str(getattr(args, k))
    ]
    if changed:
        raise Refused(f"{folder}: saved with another model: {', '.join(changed)}")
    if "seed" in args.given and saved.get("seed") != str(args.seed):
        raise Refused(
            f"--seed {args.seed}: the saved run (seed {saved.get('seed')}) continues with its own random "
            "streams and data order; drop --seed, or start a new run without --resume"
        )
    if manifest["step"] >= args.steps:
        raise Refused(f"{folder}: already at step {manifest['step']}; --steps {args.steps} adds none")


def apply_flags(args, saved: dict, optimizer) -> list[str]:
    """The flags given on the command line that differ from the saved run's. The model's were refused
    before; the learning rate is set over the loaded optimizer state (which restored the saved
    one); the others are in effect already (the model, its memory techniques and the data are
    built from them). Without --lr the saved rate stays, and ``args`` says so for the next save."""
    if "lr" in args.given:
        for group in optimizer.param_groups:
            group["lr"] = args.lr
    else:
        args.lr = optimizer.param_groups[0]["lr"]
    return [
        f"--{k.replace('_', '-')} {getattr(args, k)} (saved {saved[k]})"
        for k in args.given
        if k not in RUN_FLAGS and k in saved and saved[k] != str(getattr(args, k))
    ]


# ------------------------------------------------------------------------------------------------
# Memory shown in the progress bar


class MemoryMeter:
    """Peak memory of the run: CUDA's allocator (or the llmmem pool), or on the CPU the live tensor
    bytes counted by llmmem's LiveBytes (every allocation and free; costs a Python call per operator)."""

    def __init__(self, device, model, optimizer, pool=None) -> None:
        self.device, self.pool, self.live = device, pool, None
        if device.type == "cpu":
            from llmmem.diagnostics.live import LiveBytes

            self.live = LiveBytes()
            self.live.track([model, getattr(optimizer, "optim", optimizer)])

    def __enter__(self):
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def peak(self) -> int:
        if self.live is not None:
            return self.live.max_allocated("cpu")
        if self.pool is not None:
            stats = self.pool.stats()
            value = stats.get("allocated_bytes.peak", stats.get("allocated_bytes"))
            return int(value["peak"] if isinstance(value, dict) else value or 0)
        return torch.cuda.max_memory_allocated(self.device)


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device_obj = pick_device(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    pool = None
    if args.pool:  # before the first CUDA allocation; every CUDA tensor then comes from the pool
        pool = llmmem.MemoryPool(device=f"cuda:{device.index}")
        llmmem.install_allocator(pool)
    d = Dist(args)
    model, inner, blocks = build_model(args, device, d)
    n_params = sum(p.numel() for p in inner.parameters())
    if args.fused_head:  # before the planner: it then profiles the step as it trains
        llmmem.patch_lm_loss(inner)

    tokens = encode(args.data.read_text(encoding="utf-8", errors="replace"))
    if tokens.numel() < args.seq_len + 2:
        raise SystemExit(f"error: --data {args.data}: fewer than --seq-len + 2 bytes")
    sampler = BatchSampler(tokens, args.batch, args.seq_len, seed=args.seed)
    local = args.batch // d.dp
    micro = local // args.grad_accum
    rows = slice(d.dp_rank * local, (d.dp_rank + 1) * local)

    plan_text = None
    if args.checkpoint == "auto":
        # profile on a batch of the training shape, drawn apart from the training batches
        sample_x, sample_y = BatchSampler(tokens, micro, args.seq_len, seed=args.seed + 1).next_batch()
        plan_text = plan_checkpointing(args, model, sample_x.to(device), sample_y.to(device))
    elif args.checkpoint != "none":
        checkpoint_blocks(blocks, args.checkpoint, args.offload)

    train_model = model
    if args.fsdp != "none":
        shard_model(args, model, blocks, d)
    elif d.dp > 1:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(model, process_group=d.dp_group, gradient_as_bucket_view=True)
    optimizer = make_optimizer(args, inner, d)
    scaler = llmmem.GradScaler(device.type) if args.amp == "fp16" else None

    start, chosen, applied = 0, None, []
    if args.resume is not None:
        start, chosen, applied = resume(args.resume, inner, optimizer, scaler, sampler, device, d, args)
    in_backward = None
    if args.step_in_backward:  # after the planner's sample step and the resume: they must update nothing
        in_backward = llmmem.optim.step_in_backward(inner, optimizer)
    if d.rank == 0 and chosen is not None:
        for reason in chosen.skipped:
            print(f"warning: --resume {args.resume}: skipped a damaged set: {reason}", file=sys.stderr, flush=True)
        for name in chosen.unfinished:
            print(f"note: --resume {args.resume}: {name} is a save that never finished, ignored", file=sys.stderr)
    if d.rank == 0:
        where = f"{device}" + (f", {d.world} ranks: TP {d.tp} x DP {d.dp}" if d.world > 1 else "")
        where += f" ({args.fsdp} with FSDP2)" if args.fsdp != "none" else ""
        print(
            f"{args.model}: {n_params / 1e6:.2f}M parameters{' per rank' if d.tp > 1 else ''} on {where}; "
            f"checkpoint={args.checkpoint} amp={args.amp} optim={args.optim}"
            + (" bf16-weights" if args.bf16_weights else "")
            + (" step-in-backward" if args.step_in_backward else "")
            + (" fused-head" if args.fused_head else "")
            + (" offload" if args.offload else "")
            + (" pool" if args.pool else "")
            + (f"; resumed at step {start} from {chosen.path}" if chosen is not None else ""),
            flush=True,
        )
        if applied:
            print(f"flags applied over the saved state: {', '.join(applied)}", flush=True)
        if plan_text:
            print(plan_text, flush=True)

    bar = None
    if d.rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
    losses, grad_bytes = [], 0
    tokens_per_step = args.batch * args.seq_len
    meter = MemoryMeter(device, inner, optimizer, pool)
    model.train()
    t_run = time.perf_counter()
    # the step in backward is removed when the loop ends, however it ends: main() may run again in
    # this process (the tests do), with other flags
    with meter, in_backward if in_backward is not None else contextlib.nullcontext():
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            x_all, y_all = sampler.next_batch(rows=rows)
            total = 0.0
            for k in range(args.grad_accum):
                x = x_all[k * micro : (k + 1) * micro].to(device, non_blocking=True)
                y = y_all[k * micro : (k + 1) * micro].to(device, non_blocking=True)
                last = k == args.grad_accum - 1
                with gradient_sync(args, train_model, d, last):
                    loss = loss_of(args, train_model, x, y) / args.grad_accum
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                total += float(loss.detach())
            grad_bytes = max(grad_bytes, local_bytes(p.grad for p in inner.parameters()))
            if args.sequence_parallel:
                from llmmem.parallel import allreduce_sequence_parallel_grads

                allreduce_sequence_parallel_grads(inner, d.tp_group)
            if scaler is not None:
                # the scaler agrees over FSDP2's meshes and the TP layers' groups itself; FSDP2 replaces
                # the TP layers' tagged parameters, so under --tp --fsdp the TP ranks agree here
                if d.tp > 1 and args.fsdp != "none":
                    agree_on_overflow(inner.parameters(), d.tp_group)
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = d.mean_over_dp(total)
            if not math.isfinite(loss_value) and scaler is None:
                raise SystemExit(f"error: the loss is {loss_value} at step {step + 1}")
            losses.append([step + 1, loss_value])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if bar is not None:
                bar.set_postfix(
                    loss=f"{loss_value:.4f}",
                    tok_s=f"{tokens_per_step / dt:,.0f}",
                    mem=llmmem.format_bytes(meter.peak()),
                    refresh=False,
                )
                bar.update(1)
            if args.save is not None and args.save_every and (step + 1) % args.save_every == 0:
                save(args.save, step + 1, inner, optimizer, scaler, sampler, device, d, args)
    if bar is not None:
        bar.close()
    if args.save is not None and (not args.save_every or args.steps % args.save_every):
        save(args.save, args.steps, inner, optimizer, scaler, sampler, device, d, args)
    elapsed = time.perf_counter() - t_run
    if d.rank == 0:
        done = len(losses)
        if losses:
            print(
                f"step {args.steps}: loss {losses[-1][1]:.4f}; {done} steps in {elapsed:.1f} s "
                f"({done * tokens_per_step / max(elapsed, 1e-9):,.0f} tokens/s); peak memory "
                f"{llmmem.format_bytes(meter.peak())}"
                + (" per rank" if d.world > 1 else "")
                # a --budget bounds the activations alone: say what this figure holds
                + " (parameters, gradients and optimizer state included)",
                flush=True,
            )
        if args.log_json is not None:
            import json

            # this rank's model state, its shards alone under --fsdp and --tp
            state_bytes = {
                "parameters": local_bytes(inner.parameters()),
                "gradients": grad_bytes,
                "optimizer": local_bytes(local_state(getattr(optimizer, "optim", optimizer).state_dict())["state"]),
            }
            args.log_json.write_text(
                json.dumps({"losses": losses, "peak_bytes": meter.peak(), "model_state_bytes": state_bytes})
            )
    if d.world > 1:
        import torch.distributed as dist

        import llmmem.parallel as tp

        tp.destroy()
        if d.owns_process_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
