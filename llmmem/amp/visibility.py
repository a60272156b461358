"""The visibility part of llmmem.GradScaler (what torch's scaler has no answer to): counters of
skipped steps, the last-step-skipped flag, which parameters overflowed, and the min_scale warning.

A mixin over GradScaler's state: ``_enabled``, ``_stats`` (int64 [updates, skipped, last_skipped,
min_scale_hits] on the scale's device), ``_init_stats``, ``_min_scale``, ``_min_scale_warned`` and ``_overflow``
(id(optimizer) -> (weak reference to the optimizer, flat param_groups positions of the checked
grads, {device: (flags, positions)})): weak, so a deleted model and optimizer are freed.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch


class _ScalerVisibility:
    def _read_stats(self) -> list[int]:
        if not self._enabled:
            return [0, 0, 0, 0]
        return list(self._init_stats) if self._stats is None else [int(v) for v in self._stats.tolist()]

    def _poll_min_scale_hits(self) -> None:
        """GPU scales: learn about min_scale hits without a sync. Each update queues a 32-byte copy
        of the counters into pinned host memory plus an event; a later update reads the copy once
        the event has passed (event.query() does not wait), so the warning comes a step or so late."""
        pending = getattr(self, "_stats_poll", None)
        if pending is not None:
            host, event = pending
            if not event.query():
                return  # the previous copy is still in flight: keep it, check next time
            if int(host[3]) > 0:
                self._emit_min_scale_warning(stacklevel=4)
                return
        host = pending[0] if pending is not None else torch.empty(4, dtype=torch.int64, pin_memory=True)
        host.copy_(self._stats, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._stats.device))
        self._stats_poll = (host, event)

    def _warn_if_min_scale_hit(self) -> None:
        if not self._enabled or self._min_scale is None or self._min_scale_warned or self._stats is None:
            return
        if int(self._stats[3].item()) > 0:
            self._emit_min_scale_warning(stacklevel=4)

    def _emit_min_scale_warning(self, stacklevel: int) -> None:
        self._min_scale_warned = True
        warnings.warn(
            f"llmmem.GradScaler: the loss scale hit min_scale={self._min_scale} and stays there "
            "while gradients keep overflowing; the model may be diverging (or need bf16)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )

    def stats(self) -> dict[str, int]:
        """Counters since construction (or since the state was pickled): ``updates`` (calls of
        :meth:`update` that consumed inf checks), ``skipped_steps`` (those that found inf/NaN, i.e.
        at least one optimizer step was skipped), ``last_step_skipped`` (0/1) and ``min_scale_hits``.

        .. warning:: synchronises with the GPU.
        """
        self._warn_if_min_scale_hit()
        u, s, last, hits = self._read_stats()
        return {"updates": u, "skipped_steps": s, "last_step_skipped": last, "min_scale_hits": hits}

    def skipped_steps(self) -> int:
        """How many iterations had inf/NaN gradients (their optimizer steps were skipped).

        .. warning:: synchronises with the GPU."""
        return self.stats()["skipped_steps"]

    def last_step_skipped(self) -> bool:
        """Whether the latest :meth:`update` saw inf/NaN gradients, i.e. the step was skipped; use
        it to hold back a learning-rate scheduler. ``False`` before the first update.

        .. warning:: synchronises with the GPU."""
        return bool(self.stats()["last_step_skipped"])

    def overflowed_params(
        self, module: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None
    ) -> list:
        """Which parameters had inf/NaN gradients in the latest check (the current iteration's, or
        the previous one's until the next :meth:`unscale_`/:meth:`step`).

        Args:
            module: when given, parameters are reported by their names in ``module.named_parameters()``
                (parameters not found there by index).
            optimizer: only this optimizer's parameters (default: all optimizers checked).

        Returns:
            a list of names (str), or of ``(group_index, param_index)`` tuples into
            ``optimizer.param_groups`` when no module names them. A DTensor parameter (FSDP2,
            tensor parallelism) is listed when its gradient's shard overflowed on any rank: every
            rank gets the same list, agreed when the gradients were checked (no collective here).

        .. warning:: synchronises with the GPU (reads the per-gradient flags).
        """
        if not self._enabled:
            return []
        names = {}
        if module is not None:
            for n, p in module.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), n)  # a tied weight is reported by its first name
        out = []
        items = self._overflow.items() if optimizer is None else [(id(optimizer), self._overflow.get(id(optimizer)))]
        for _, info in items:
            if info is None:
                continue
            opt_ref, slots, per_device = info
            opt = opt_ref()
            if opt is None:  # the optimizer was deleted: its parameters are gone too
                continue
            hit = set()
            for flags, pos in per_device.values():
                for j, f in enumerate(flags.tolist()):
                    if f:
                        hit.add(pos[j])
            flat = [(gi, pi, p) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])]
            for k in sorted(hit, key=slots.__getitem__):  # in the optimizer's order, on every rank alike
                if slots[k] >= len(flat):  # param_groups shrank since the check
                    continue
                gi, pi, param = flat[slots[k]]
                out.append(names.get(id(param), (gi, pi)))
        return out
