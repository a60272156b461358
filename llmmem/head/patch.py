"""``llmmem.patch_lm_loss``: a causal language model whose loss, when it is given labels, comes from
the last hidden states and the head's weight through :func:`llmmem.linear_cross_entropy`, so the
[tokens x vocabulary] logits, their fp32 upcast and their gradient never exist whole.

    handle = llmmem.patch_lm_loss(model)   # Hugging Face *ForCausalLM, or llmmem's GPT
    out = model(input_ids=ids, labels=ids)  # out.loss as before; out.logits is None
    handle.remove()                         # the model's own forward again

How: the model's own ``forward`` still runs, with ``labels=None`` (its caches, attention outputs,
router logits and output class are its own), while a forward pre-hook on the head keeps the
head's input (the hidden states after the final norm, sliced by ``logits_to_keep`` as the model
slices them) and hands the head zero rows, so the head makes an empty logits tensor. The hook is
registered at patch time and open only during a labeled call: one registered per call is a side
effect ``torch.compile(model, fullgraph=True)`` cannot trace. The loss is then Hugging Face's
``ForCausalLMLoss`` on those hidden states: labels shifted by one (or ``shift_labels`` as given),
``ignore_index`` (-100), the mean over the tokens not ignored, or the sum over
``num_items_in_batch`` when the Trainer passes it (gradient accumulation); Gemma 2 and 3's
``final_logit_softcapping``; plus ``router_aux_loss_coef x aux_loss`` for Mixtral when the model
returns its router loss. What differs per architecture is a row of :data:`ARCHITECTURES`.

The patch is an instance-level ``forward`` (an object that pickles and deep-copies with the model,
as does the head's hook: a copy stays patched; :func:`unpatch_lm_loss` undoes it there), the hook
and the mark of :mod:`llmmem.head.marker`; parameters, ``state_dict`` keys, ``generate`` and calls
without labels are untouched. ``inspect.signature(model.forward)`` is the model's own (the Trainer
reads it).

Not covered: models whose head is not a plain ``nn.Linear`` (a LoRA-wrapped or quantized head:
refused), a head under accelerate's hooks (``cpu_offload``, a ``device_map`` that offloads or
splits the model: the weight is moved in only inside the head's forward; refused), a custom
``model.loss_function`` (refused), double backward (``create_graph=True``: refused in backward),
``nn.DataParallel`` (its replicas share the instance ``forward``, which belongs to the original
model: use DDP), and the Trainer's ``label_smoothing_factor`` (it takes the labels away from the
model and needs the logits: the model then runs unpatched, as it must).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmmem.head.loss import _linear_cross_entropy
from llmmem.head.marker import FusedHead, fused_head, mark, unmark

__all__ = ["patch_lm_loss", "unpatch_lm_loss", "LmLossPatch", "ARCHITECTURES"]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one model class computes its loss, in the terms :func:`patch_lm_loss` needs."""

    head: str = "lm_head"  # attribute holding the head, an nn.Linear [vocab, hidden]
    labels: str = "labels"  # forward's argument carrying the labels
    hugging_face: bool = True  # labels shifted inside, ModelOutput returned; else llmmem's GPT
    softcap: Optional[str] = None  # config attribute of the final logit soft-capping
    aux_coef: Optional[str] = None  # model attribute weighting the output's aux_loss into the loss


_HF = Architecture()
_SOFTCAP = Architecture(softcap="final_logit_softcapping")
_MOE = Architecture(aux_coef="router_aux_loss_coef")

# (module prefix, class name) -> how it computes its loss. A class is matched through its MRO; a
# subclass that overrides forward is refused (its loss may be anything).
ARCHITECTURES = {
    ("transformers.", "LlamaForCausalLM"): _HF,
    ("transformers.", "MistralForCausalLM"): _HF,
    ("transformers.", "Qwen2ForCausalLM"): _HF,
    ("transformers.", "Qwen3ForCausalLM"): _HF,
    ("transformers.", "GemmaForCausalLM"): _HF,
    ("transformers.", "Gemma2ForCausalLM"): _SOFTCAP,
    ("transformers.", "Gemma3ForCausalLM"): _SOFTCAP,
    ("transformers.", "Phi3ForCausalLM"): _HF,
    ("transformers.", "GPT2LMHeadModel"): _HF,
    ("transformers.", "GPTNeoXForCausalLM"): _HF,
    ("transformers.", "Olmo2ForCausalLM"): _HF,
    ("transformers.", "MixtralForCausalLM"): _MOE,
    ("llmmem.models.gpt", "GPT"): Architecture(head="head", labels="targets", hugging_face=False),
}


def _supported_names() -> str:
    return ", ".join(name for _, name in ARCHITECTURES)


def _architecture(model: nn.Module) -> Architecture:
    cls = type(model)
    for base in cls.__mro__:
        for (prefix, name), arch in ARCHITECTURES.items():
            if base.__name__ == name and base.__module__.startswith(prefix):
                if cls.forward is not base.forward:
                    raise TypeError(
                        f"patch_lm_loss: {cls.__name__} overrides {name}.forward, so its loss may be computed "
                        f"otherwise; patch_lm_loss reproduces only {name}'s own loss"
                    )
                return arch
    hint = ""
    if hasattr(model, "get_base_model"):  # PEFT's wrappers
        hint = " (a PEFT wrapper: patch the model inside it, model.get_base_model())"
    raise TypeError(
        f"patch_lm_loss: {cls.__module__}.{cls.__name__} is not an architecture it knows{hint}; it patches "
        f"{_supported_names()}"
    )


def _head(model: nn.Module, arch: Architecture) -> nn.Linear:
    head = getattr(model, arch.head, None)
    where = f"{type(model).__name__}.{arch.head}"
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        cls = type(head)
        raise TypeError(
            f"patch_lm_loss: {where} is a {cls.__module__}.{cls.__qualname__}, not a plain torch.nn.Linear (an "
            "adapter or a quantized head computes more than weight and bias, which the fused loss would leave out)"
        )
    hook = getattr(head, "_hf_hook", None)
    if hook is not None or "forward" in head.__dict__:
        by = f"accelerate's {type(hook).__name__}" if hook is not None else "an instance attribute"
        raise TypeError(
            f"patch_lm_loss: {where}'s forward is replaced by {by} (accelerate's cpu_offload, or a device_map that "
            "offloads or splits the model, hooks it): its weight may be on the meta device or another device until "
            "that forward moves it, and the fused loss reads the weight itself. Load the model with the head on "
            "the device that computes the loss, not offloaded"
        )
    return head


def _check_loss_function(model: nn.Module) -> None:
    """Refuses a Hugging Face model whose ``loss_function`` is not ``ForCausalLMLoss``: its loss is
    someone else's, which this patch would silently replace."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    current = getattr(model, "loss_function", ForCausalLMLoss)
    if current is not ForCausalLMLoss:
        raise ValueError(
            f"patch_lm_loss: {type(model).__name__} computes its loss with another loss_function "
            f"({getattr(current, '__name__', current)!r}); patch_lm_loss reproduces only ForCausalLMLoss"
        )


def _is_tied(model: nn.Module, weight: torch.Tensor) -> bool:
    return any(isinstance(m, nn.Embedding) and m.weight is weight for m in model.modules())


def _softcap(model: nn.Module, arch: Architecture) -> Optional[float]:
    if arch.softcap is None:
        return None
    value = getattr(model.config, arch.softcap, None)
    return float(value) if value else None


class _Capture:
    """Forward pre-hook on the head, registered once by :func:`patch_lm_loss` and open only during
    a labeled call (a hook registered per call is a side effect ``torch.compile(fullgraph=True)``
    cannot trace): keeps the head's input and gives the head zero rows of it."""

    def __init__(self) -> None:
        self.open = False
        self.calls = 0
        self.hidden: Optional[torch.Tensor] = None

    def __call__(self, module, args):
        if not self.open:
            return None
        x = args[0]
        self.calls += 1
        self.hidden = x
        return (x.narrow(-2, 0, 0),) + tuple(args[1:])


def _remove_captures(model: nn.Module, capture: Optional[_Capture]) -> None:
    """Removes ``capture`` (None: any :class:`_Capture`) from the forward pre-hooks of ``model``'s
    modules."""
    for module in model.modules():
        hooks = module._forward_pre_hooks
        for key in [k for k, v in hooks.items() if v is capture or (capture is None and isinstance(v, _Capture))]:
            del hooks[key]


def _operands(h: torch.Tensor, head: nn.Linear):
    """The head's operands in the dtype its matmul would run in: autocast's when it is on (as
    ``F.linear`` under autocast), else the weight's."""
    w, b = head.weight, head.bias
    device = h.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = w.dtype
    return h.to(dtype), w.to(dtype), (b.to(dtype) if b is not None else None)


class LmLossPatch:
    """The instance-level ``forward`` of a patched model (see the module docstring). Its state is
    plain data, so the model pickles and deep-copies with it."""

    def __init__(self, model: nn.Module, arch: Architecture, chunk_size: Optional[int], prior) -> None:
        self.model = model
        self.arch = arch
        self.chunk_size = chunk_size
        self.prior = prior  # an instance-level forward that was there before (None: the class's)
        self.labels_position = _labels_position(self._original(), arch.labels)
        self.capture = _Capture()
        self.hooked: Optional[nn.Module] = None  # the head whose pre-hooks hold self.capture
        self.removed = False  # removed from inside accelerate's wrapper: passes every call through

    def _original(self):
        if self.prior is not None:
            return self.prior
        return type(self.model).forward.__get__(self.model, type(self.model))

    def _run_original(self, args, kwargs):
        # calls the class's forward unbound: a bound method made here (function.__get__) is
        # something torch.compile(fullgraph=True) cannot trace
        if self.prior is not None:
            return self.prior(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def hook(self, head: nn.Module) -> None:
        """Puts the capture hook on ``head`` (once; again where the head was replaced)."""
        if self.hooked is head:
            return
        if self.hooked is not None:
            _remove_captures(self.hooked, self.capture)
        head.register_forward_pre_hook(self.capture)
        self.hooked = head

    @property
    def __signature__(self) -> inspect.Signature:
        # the model's own: the Trainer keeps the dataset columns named in it and reads **kwargs from it
        return inspect.signature(self._original())

    def __call__(self, *args, **kwargs):
        if args and args[0] is self.model:
            # bound to the model as a method (accelerate's unwrap_model(keep_fp32_wrapper=False) rebinds
            # the forward it wrapped so): the model is never an input of its own forward
            args = args[1:]
        if self.removed:
            return self._run_original(args, kwargs)
        name, pos = self.arch.labels, self.labels_position
        if name in kwargs:
            labels = kwargs.pop(name)
        elif pos is not None and len(args) > pos:
            labels, args = args[pos], args[:pos] + (None,) + args[pos + 1 :]
        else:
            labels = None
        if labels is None:
            return self._run_original(args, kwargs)
        return self._fused(labels, args, kwargs)

    def _fused(self, labels, args, kwargs):
        model, arch = self.model, self.arch
        head = _head(model, arch)
        want_dict = True
        if arch.hugging_face:
            _check_loss_function(model)
            # as transformers' can_return_tuple: the argument, else the config
            want_dict = kwargs.pop("return_dict", None)
            if want_dict is None:
                want_dict = getattr(model.config, "return_dict", True)
            kwargs["return_dict"] = True
        self.hook(head)
        capture = self.capture
        capture.open, capture.calls, capture.hidden = True, 0, None
        try:
            out = self._run_original(args, kwargs)
            calls, hidden = capture.calls, capture.hidden
        finally:
            capture.open, capture.hidden = False, None
        if calls != 1:
            raise RuntimeError(
                f"patch_lm_loss: {type(model).__name__}'s forward called its head {calls} times "
                "(expected once); its loss cannot be taken from the head's input"
            )
        loss = self._loss(hidden, head, labels, kwargs)
        if not arch.hugging_face:
            return None, loss  # llmmem's GPT: (logits, loss)
        aux = getattr(out, "aux_loss", None)
        if arch.aux_coef is not None and aux is not None:
            loss = loss + getattr(model, arch.aux_coef) * aux.to(loss.device)
        fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
        fields.update(loss=loss, logits=None)
        result = type(out)(**fields)
        return result if want_dict else result.to_tuple()

    def _loss(self, hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, kwargs: dict) -> torch.Tensor:
        arch = self.arch
        ignore_index = kwargs.get("ignore_index", -100) if arch.hugging_face else -100
        num_items = kwargs.get("num_items_in_batch") if arch.hugging_face else None
        target = labels
        if arch.hugging_face:
            target = kwargs.get("shift_labels")
            if target is None:  # tokens < n predict n, as ForCausalLMLoss shifts them
                target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        h = hidden.reshape(-1, hidden.shape[-1])
        target = target.reshape(-1).to(device=h.device, dtype=torch.long)
        if target.shape[0] != h.shape[0]:
            raise ValueError(
                f"patch_lm_loss: {type(self.model).__name__}'s head saw {h.shape[0]} positions (after "
                f"logits_to_keep) and the labels give {target.shape[0]} targets; they must match, as for the "
                "unpatched model's loss"
            )
        h, w, b = _operands(h, head)
        with torch.autocast(h.device.type, enabled=False):  # the operands' dtype is settled
            loss = _linear_cross_entropy(
                h,
                w,
                target,
                b,
                int(ignore_index),
                "mean" if num_items is None else "sum",
                0.0,
                _softcap(self.model, arch),
                self.chunk_size,
                None,
                torch.float32,  # as ForCausalLMLoss's; its gradient then too (a loss scale of 2**16 is inf in fp16)
            )
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        return loss


def _labels_position(forward, name: str) -> Optional[int]:
    """Index of ``name`` among ``forward``'s positional arguments, None if it cannot be positional."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            return None
        if p.name == name:
            return i
    return None


class PatchHandle:
    """What :func:`patch_lm_loss` returns: ``.remove()`` (idempotent) puts the model's forward back
    exactly as it was and unmarks it; also a context manager that removes on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def remove(self) -> None:
        unpatch_lm_loss(self.model, missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if fused_head(self.model) is not None else "removed"
        return f"<patch_lm_loss of {type(self.model).__name__}: {state}>"


def patch_lm_loss(model: nn.Module, *, chunk_size: Optional[int] = None) -> PatchHandle:
    """Make ``model``'s loss the fused head's: given labels, ``model(...)`` returns the loss that the
    unpatched model returns (Hugging Face's label shift, ``ignore_index=-100``, ``num_items_in_batch``,
    ``logits_to_keep``, Gemma 2/3's final logit soft-capping, Mixtral's router aux loss) with
    ``logits=None``; without labels it returns the logits as before. See the module docstring.

    Supported: Hugging Face's ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
    ``Qwen3ForCausalLM``, ``GemmaForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM`` (text),
    ``Phi3ForCausalLM``, ``GPT2LMHeadModel``, ``GPTNeoXForCausalLM``, ``Olmo2ForCausalLM``,
    ``MixtralForCausalLM``, and llmmem's :class:`~llmmem.models.gpt.GPT` (``model(idx, targets)``
    returns ``(None, loss)``).

    :param chunk_size: rows of logits a chunk (None: from the memory target of
        :func:`llmmem.linear_cross_entropy`).
    :returns: a handle; ``handle.remove()`` undoes the patch.
    :raises TypeError: an architecture it does not know (named), a subclass that overrides the
        forward, a head that is not a plain ``nn.Linear``, or one whose forward accelerate hooked
        (``cpu_offload``, an offloading or multi-device ``device_map``).
    :raises ValueError: the model is patched already (patching twice is refused: remove first), or
        its loss function is a custom one.

    Memory: the loss holds one chunk of logits instead of the [tokens x vocabulary] logits, their fp32
    copy and their gradient; the gradients of the hidden states and of the head's weight are
    computed in the forward (see :func:`llmmem.linear_cross_entropy`). Synchronisation: one host
    synchronisation per call on a GPU (the labels' range check). The loss is fp32 whatever the
    model's dtype, as Hugging Face's (llmmem's GPT too), and so is its upstream gradient: fp16 with a
    loss scaler works as it does unpatched (in fp16 the head's gradients are computed in backward,
    one more matmul: see :mod:`llmmem.head.loss`). Under ``torch.compile`` (``fullgraph=True``
    included) the same loss and gradients.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_lm_loss: model must be an nn.Module, got {type(model).__name__}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"patch_lm_loss: chunk_size must be None or an int > 0, got {chunk_size!r}")
    installed = _installed(model)
    if (installed is not None and not installed.removed) or fused_head(model) is not None:
        raise ValueError(
            f"patch_lm_loss: this {type(model).__name__} is patched already; call .remove() on the handle the "
            "first patch_lm_loss returned (or llmmem.head.unpatch_lm_loss(model)) before patching it again"
        )
    arch = _architecture(model)
    head = _head(model, arch)
    if arch.hugging_face:
        _check_loss_function(model)
    prior = model.__dict__.get("forward")
    patched = LmLossPatch(model, arch, chunk_size, prior)
    vocab, hidden = head.weight.shape
    info = FusedHead(
        vocab=int(vocab),
        hidden=int(hidden),
        softcap=_softcap(model, arch),
        tied=_is_tied(model, head.weight),
        chunk_size=chunk_size,
    )
    patched.hook(head)
    model.forward = patched  # nn.Module.__setattr__: a plain instance attribute (not a module)
    mark(model, info)
    return PatchHandle(model)


def _installed(model: nn.Module) -> Optional[LmLossPatch]:
    """The patch that is ``model``'s forward (also bound to it as a method), else None."""
    current = model.__dict__.get("forward")
    if isinstance(getattr(current, "__func__", None), LmLossPatch) and current.__self__ is model:
        current = current.__func__
    return current if isinstance(current, LmLossPatch) else None


def _inside_accelerate(model: nn.Module) -> Optional[LmLossPatch]:
    """The patch that accelerate's mixed-precision wrapper wraps (``Accelerator.prepare``, as the
    Trainer's ``bf16=True``/``fp16=True`` does: it keeps the wrapped forward as ``_original_forward``
    and reaches it through ``__wrapped__``), else None."""
    inner = model.__dict__.get("_original_forward")
    inner = getattr(inner, "__func__", inner)
    if not isinstance(inner, LmLossPatch) or inner.model is not model:
        return None
    f = model.__dict__.get("forward")
    for _ in range(8):  # accelerate's chain is 2-3 deep; a bound, should some __wrapped__ loop
        f = getattr(f, "__func__", f)
        if f is inner or f is None:
            break
        f = getattr(f, "__wrapped__", None)
    return inner if f is inner else None


def unpatch_lm_loss(model: nn.Module, *, missing_ok: bool = False) -> None:
    """Undo :func:`patch_lm_loss` on ``model`` (or on a copy of a patched model): its forward as it
    was before the patch, and no mark. Where accelerate's mixed-precision wrapper wraps the patch
    (``Accelerator.prepare``, the Trainer with ``bf16=True`` or ``fp16=True``), the wrapper stays,
    since it holds the autocast the Trainer's later calls rely on, and the patch inside it passes
    every call through to the forward it replaced.

    :raises ValueError: ``model`` is not patched (unless ``missing_ok``), or its ``forward`` was
        replaced after the patch by another wrapper (which would be lost: remove that one first).
    """
    current = _installed(model)
    if current is not None:
        if current.prior is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = current.prior
        _remove_captures(model, current.capture)
        current.hooked = None
        unmark(model)
        return
    inner = _inside_accelerate(model)
    if inner is not None and not inner.removed:
        inner.removed = True
        _remove_captures(model, inner.capture)
        inner.hooked = None
        unmark(model)
        return
    current = model.__dict__.get("forward")
    if fused_head(model) is not None and current is None:  # its forward deleted by hand: only the mark is left
        _remove_captures(model, None)
        unmark(model)
        return
    if fused_head(model) is not None:
        raise ValueError(
            f"patch_lm_loss: {type(model).__name__}.forward was replaced after patch_lm_loss (now "
            f"{type(current).__name__}); remove that wrapper first, then the patch"
        )
    if missing_ok:
        return
    raise ValueError(f"patch_lm_loss: this {type(model).__name__} is not patched")
