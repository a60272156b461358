"""Fixed-seed training runs that compare optimizers by the loss they reach: what
``benchmarks/bench_optim.py --convergence`` prints and ``tests/optim/test_convergence.py`` checks.

Two tasks, both deterministic for a given optimizer:

- ``teacher_student``: an MLP (64 -> 256 -> 256 -> 16, tanh) learns a fixed random teacher of the
  same shape by mean squared error on fresh random inputs; the loss is the mean over the last
  20 steps.
- ``gpt``: llmmem's GPT (2 layers, hidden 64, dropout 0) on the generated corpus, byte tokens;
  the loss is taken on 4 fixed held-out batches after the last step.
"""

from __future__ import annotations

from typing import Callable

import torch


def teacher_student(make: Callable, steps: int = 400, dtype: torch.dtype = torch.float32) -> float:
    """Final loss of a student trained by the optimizer ``make(params)``, weights in ``dtype``."""

    def mlp():
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.Tanh(),
            torch.nn.Linear(256, 256),
            torch.nn.Tanh(),
            torch.nn.Linear(256, 16),
        )

    torch.manual_seed(0)
    teacher = mlp()
    torch.manual_seed(1)
    student = mlp().to(dtype)
    opt = make(student.parameters())
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 64, generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(student(x.to(dtype)).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return sum(losses[-20:]) / 20


def gpt(make: Callable, steps: int = 2000, dtype: torch.dtype = torch.float32) -> float:
    """Held-out loss of a small GPT trained by the optimizer ``make(params)``, weights in ``dtype``."""
    from llmmem.compare.corpus import BatchSampler, encode, generate_text
    from llmmem.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, seq_len=64, vocab_size=256, dropout=0.0)).to(dtype)
    opt = make(model.parameters())
    tokens = encode(generate_text(200_000))
    train = BatchSampler(tokens, batch=16, seq=64, seed=0)
    for _ in range(steps):
        x, y = train.next_batch()
        _, loss = model(x, y)
        opt.zero_grad()
        loss.float().backward()
        opt.step()
    held_out = BatchSampler(tokens, batch=32, seq=64, seed=123)
    with torch.no_grad():
        return sum(float(model(*held_out.next_batch())[1]) for _ in range(4)) / 4
