"""A row of the model-state preset (``python -m llmmem compare --preset finetune``), trained and
measured in its worker process, and its headline: the largest model that fits in the baseline's peak.

The row is built as a user would build it: the GPT (in bf16 with ``bf16_weights``), the planner
(``llmmem.auto_checkpoint`` with a fractional budget), the optimizer (torch's AdamW or
``llmmem.optim.AdamW`` with its moments in fp32, bf16, int8 or int4) and, last,
``llmmem.optim.step_in_backward`` (after the planner, whose sample step must update nothing). It
trains ``steps`` steps beside the fp32 reference as every row does (:mod:`llmmem.compare.measure`).

The largest model, by depth: the row's peak is measured at two depths (its own and
``spec["fit_layers"]``), a line ``peak = a * params + b`` is fitted through them (``a``: the
bytes each parameter costs, its share of the activations included; ``b``: what does not grow with
the model), the depth whose parameters the line puts at the baseline's peak is run to verify it,
and then its neighbour, so that the answer is a model measured to fit and one measured not to
(:func:`llmmem.compare.measure.search_largest`). Each size is a fresh model and optimizer: a step
to make the state, then the measured step.
"""

from __future__ import annotations

import gc
import os

import torch

import llmmem
from llmmem.compare import measure
from llmmem.compare.corpus import BatchSampler
from llmmem.compare.strategies import Strategy
from llmmem.compare.training import (
    PhaseClock,
    Planned,
    Trainer,
    corpus_tokens,
    install_techniques,
    make_optimizer,
    pick_device,
    reference_trainer,
    row_header,
)
from llmmem.models.gpt import GPT, GPTConfig

__all__ = ["Built", "build", "fit_line", "run_row"]


class Built:
    """A row's model, planner (or None) and trainer at one size."""

    def __init__(self, model: GPT, planned: Planned | None, trainer: Trainer) -> None:
        self.model, self.planned, self.trainer = model, planned, trainer

    @property
    def params(self) -> int:
        return self.model.num_parameters()

    def close(self) -> None:
        self.trainer.close()
        if self.planned is not None and self.planned.plan is not None:
            self.planned.plan.remove()


def build(spec: dict, strategy: Strategy, device, layers: int, sample) -> Built:
    """The row's model of ``layers`` layers with its techniques; ``sample`` is the planner's batch.

    :raises llmmem.InfeasibleError: when the strategy's plan fits no budget at this size.
    """
    cfg = GPTConfig(**{**spec["model"], "layers": layers})
    torch.manual_seed(spec["seed"])  # every row, at every size, starts from the same weights
    model = GPT(cfg).to(device)
    if strategy.bf16_weights:
        model.to(torch.bfloat16)
    planned = install_techniques(model, strategy, spec, device, sample)
    optimizer = make_optimizer(model.parameters(), spec["lr"], optim=strategy.optim, seed=spec["seed"])
    return Built(model, planned, Trainer(model, optimizer, strategy, device))


def fit_line(points) -> tuple[float, float]:
    """``(a, b)`` of ``peak = a * params + b`` through two ``(params, peak)`` points."""
    (p1, y1), (p2, y2) = sorted(points)
    if p1 == p2:
        raise ValueError("fit_line: two different model sizes are needed")
    a = (y2 - y1) / (p2 - p1)
    return a, y1 - a * p1


def run_row(spec: dict) -> dict:
    """Train and measure the row ``spec["strategy"]``, then find the largest model (see the module)."""
    clock = PhaseClock(spec)
    strategy = Strategy(**spec["strategy"])
    torch.set_num_threads(int(spec.get("threads", 1)))
    device = pick_device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seed, batch, steps = spec["seed"], spec["batch"], spec["steps"]
    layers, fit_layers = spec["model"]["layers"], int(spec["fit_layers"])
    if fit_layers == layers or fit_layers < 1:
        raise ValueError(f"fit_layers ({fit_layers}) must be >= 1 and differ from the model's layers ({layers})")
    cfg = GPTConfig(**spec["model"])
    tokens = corpus_tokens(spec.get("tokens", "bytes"))
    sample = BatchSampler(tokens, batch, cfg.seq_len, seed=seed + 1).next_batch()  # the planner's, apart
    try:
        built = build(spec, strategy, device, layers, sample)
    except llmmem.InfeasibleError as exc:
        torch.manual_seed(seed)
        params = GPT(cfg).num_parameters()
        result = row_header(spec, strategy, device, params, params)
        result.update(error=f"infeasible: {exc}", infeasible=True, seconds=clock.seconds)
        return result
    result = row_header(spec, strategy, device, built.params, built.params)
    result["seconds"] = clock.seconds
    result["parent_pid"] = os.getppid()
    clock.lap("build")
    sampler = BatchSampler(tokens, batch, cfg.seq_len, seed=seed)

    def batches():
        x, y = sampler.next_batch()
        return x.to(device), y.to(device)

    result.update(
        measure.train_and_measure(
            built.trainer, batches, steps, device, reference=reference_trainer(cfg, spec, device)
        )
    )
    if built.planned is not None:
        result["plan"] = built.planned.describe()
    # what the step starts from, a parameter: its weight, its gradient (unless stepped in backward)
    # and its optimizer state (the batch's few bytes included)
    result["state_bytes_per_param"] = result["start_bytes"] / built.params
    built.close()
    del built
    gc.collect()
    clock.lap("train")

    cap = spec.get("cap_bytes") or result["peak_bytes"]
    trial_sampler = BatchSampler(tokens, batch, cfg.seq_len, seed=seed + 2)
    params_by_layers = {layers: result["params"]}

    def peak_with_layers(n: int) -> int | None:
        try:
            trial = build(spec, strategy, device, n, sample)
        except llmmem.InfeasibleError:
            return None  # no plan fits at this size: counts as not fitting
        try:
            params_by_layers[n] = trial.params
            x, y = trial_sampler.next_batch()
            trial.trainer.step(x.to(device), y.to(device))  # the optimizer state is made
            x, y = trial_sampler.next_batch()
            return measure.measured_step(trial.trainer, x.to(device), y.to(device), device)["peak_bytes"]
        finally:
            trial.close()
            del trial
            gc.collect()

    fit_peak = peak_with_layers(fit_layers)
    search: dict = {"kind": "model", "fit_layers": fit_layers}
    if fit_peak is None:
        search.update(largest=None, exact=False, trials=[], error=f"no plan fits at {fit_layers} layers")
        result["search"] = search
        return result
    a, b = fit_line([(result["params"], result["peak_bytes"]), (params_by_layers[fit_layers], fit_peak)])
    per_layer = (result["params"] - params_by_layers[fit_layers]) / (layers - fit_layers)
    fixed_params = result["params"] - per_layer * layers  # embeddings and the final norm
    predicted_params = (cap - b) / a if a > 0 else None
    predicted_layers = max(1, int((predicted_params - fixed_params) // per_layer)) if predicted_params else None
    found = measure.search_largest(
        peak_with_layers,
        start=layers,
        start_peak=result["peak_bytes"],
        cap=cap,
        trials=int(spec["search_trials"]),
        kind="layers",
        first=predicted_layers,
        known={fit_layers: fit_peak},
    )
    peaks = dict(found["trials"])
    peaks.update({layers: result["peak_bytes"], fit_layers: fit_peak})
    largest = found["largest"]
    search.update(
        cap_bytes=cap,
        fit={
            "bytes_per_param": a,
            "fixed_bytes": b,
            "points": [[layers, result["peak_bytes"]], [fit_layers, fit_peak]],
        },
        predicted_params=predicted_params,
        predicted_layers=predicted_layers,
        trials=found["trials"],
        largest=largest,
        exact=found["exact"],
        largest_params=params_by_layers.get(largest) if largest is not None else None,
        largest_peak_bytes=peaks.get(largest) if largest is not None else None,
        params={str(k): v for k, v in sorted(params_by_layers.items())},
    )
    result["search"] = search
    clock.lap("search")
    return result
