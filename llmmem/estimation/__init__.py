"""Sizing before you run: the memory of training a model (parameters, gradients, optimizer state,
activations) for a given batch, precision, parallelism and checkpointing, and what makes it fit.
Pure Python: no torch or GPU needed for a named model."""

from llmmem.estimation.estimator import Estimate, estimate

__all__ = ["estimate", "Estimate"]
