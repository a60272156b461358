"""Models and steps shared by the diagnostics tests: llmmem's GPT and Hugging Face Llama / GPT-2
built from small configs with random weights (never downloaded)."""

from __future__ import annotations

import pytest
import torch

from llmmem.models.gpt import GPT, GPTConfig


def tiny_gpt(seed: int = 0, **overrides):
    """A 2-layer GPT (dropout 0.1, explicit attention) and its AdamW optimizer."""
    torch.manual_seed(seed)
    dims = dict(vocab_size=256, seq_len=64, layers=2, heads=4, hidden=64)
    dims.update(overrides)
    model = GPT(GPTConfig(**dims))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def checkpoint_blocks(model) -> None:
    """Wraps each of a GPT's blocks in ``llmmem.checkpoint`` (a module whose forward is one region)."""
    import llmmem

    class Checkpointed(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return llmmem.checkpoint(self.block, x)

    model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)


def gpt_step(model, opt, batch: int, *, seq: int | None = None, zero: bool = True):
    """One training step on random token ids made inside (so a tracker sees them made)."""
    seq = seq or model.cfg.seq_len
    idx = torch.randint(0, model.cfg.vocab_size, (batch, seq))
    logits, loss = model(idx, targets=idx)
    del logits
    loss.backward()
    opt.step()
    if zero:
        opt.zero_grad(set_to_none=True)


class PeftLike(torch.nn.Module):
    """What llmmem reads of a PEFT model (peft is not a test dependency): a module around the model,
    ``get_base_model()``, and the model's other attributes (``config``, ``cfg``), which PEFT forwards."""

    def __init__(self, model) -> None:
        super().__init__()
        self.base_model = model

    def get_base_model(self):
        return self.base_model

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)


def opt_model(vocab_size: int, seed: int = 0):
    """A small Hugging Face OPT (an architecture llmmem.patch_lm_loss does not patch)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(seed)
    cfg = transformers.OPTConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        ffn_dim=128,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=512,
    )
    return transformers.OPTForCausalLM(cfg)


def hf_model(kind: str, seed: int = 0):
    """A small Hugging Face causal LM (``"llama"`` or ``"gpt2"``), eager attention; skips the test
    when transformers is not importable."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(seed)
    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="eager",
            **special,
        )
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_implementation="eager", **special
    )
    return transformers.GPT2LMHeadModel(cfg)


def hf_step(model, opt, batch: int, seq: int = 32):
    ids = torch.randint(0, 256, (batch, seq))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    del out
    opt.step()
    opt.zero_grad(set_to_none=True)


def storage_bytes(tensors) -> dict:
    """{storage id: bytes} of the tensors' storages, each once."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            out[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return out


def saved_by_graph(root) -> dict:
    """{storage id: bytes} of every tensor the autograd graph under ``root`` (a tensor) saved for
    backward, found by walking its nodes: an independent count of what is kept for backward."""
    out, seen, stack = {}, set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            value = getattr(node, name)
            values = value if isinstance(value, (list, tuple)) else [value]
            # A Python float in `x * 0.25` becomes a 0-dim float64 tensor made by the argument parser,
            # not by an operator, and autograd saves it without calling saved-tensor hooks: no
            # counter of operator outputs sees these 8 bytes.
            values = [
                v for v in values if not (isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == torch.float64)
            ]
            out.update(storage_bytes(values))
        stack.extend(nxt for nxt, _ in node.next_functions)
    return out


def hooks_left() -> dict:
    """What trackers may leave behind: torch's global module and optimizer hooks (process-wide), the
    calling thread's dispatch modes and saved-tensor hooks, and torch's process-wide "in a dispatch
    mode" flag. All zero / False when nothing is left."""
    import torch.utils._python_dispatch as dispatch
    from torch.nn.modules import module
    from torch.optim import optimizer

    return {
        "module_hooks": len(module._global_forward_pre_hooks) + len(module._global_forward_hooks),
        "optimizer_hooks": len(optimizer._global_optimizer_pre_hooks) + len(optimizer._global_optimizer_post_hooks),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "saved_tensors_hooks": torch._C._autograd._top_saved_tensors_default_hooks(True) is not None,
        "in_dispatch_mode": dispatch.is_in_torch_dispatch_mode(),
    }


NOTHING_LEFT = {
    "module_hooks": 0,
    "optimizer_hooks": 0,
    "dispatch_modes": 0,
    "saved_tensors_hooks": False,
    "in_dispatch_mode": False,
}
