"""The main job, ``python -m llmmem compare``: every memory technique on one GPT, measured.

* :mod:`~llmmem.compare.strategies`: the strategies (rows) and the model sizes of a run;
* :mod:`~llmmem.compare.worker`: one strategy trained and measured in a fresh process;
* :mod:`~llmmem.compare.measure`: what a step's memory and time are, and the largest-fit search;
* :mod:`~llmmem.compare.report`: the table, the targets, the charts;
* :mod:`~llmmem.compare.cli`: the command;
* :mod:`~llmmem.compare.corpus`: the generated text and the batch sampler.

The parallel rows use :class:`llmmem.parallel.SequenceParallelGPT`, as ``examples/train_gpt.py --tp`` does.

Importing this package imports no torch.
"""

from __future__ import annotations

import os

__all__ = ["worker_path"]


def worker_path() -> str:
    """The file of :mod:`llmmem.compare.worker` (the ranks of a parallel row load it by path)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
