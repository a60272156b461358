"""``llmmem.patch_lm_loss``: a causal language model whose loss, when it is given labels, comes from
the last hidden states and the head's weight through :func:`llmmem.linear_cross_entropy`, so the
[tokens x vocabulary] logits, their fp32 upcast and their gradient never exist whole.

    handle = llmmem.patch_lm_loss(model)   # Hugging Face *ForCausalLM, or llmmem's GPT
    out = model(input_ids=ids, labels=ids)  # out.loss as before; out.logits is None
    handle.remove()                         # the model's own forward again

How: the model's own ``forward`` still runs, with ``labels=None`` (its caches, attention outputs,
router logits and output class are its own), while a forward pre-hook on the head keeps the
head's input (the hidden states after the final norm, sliced by ``logits_to_keep`` as the model
slices them) and hands the head zero rows, so the head makes an empty logits tensor. The hook
stays on the head while the patch is on and acts only during a call with labels, so that
``torch.compile`` of the patched model traces one graph (``fullgraph=True`` works: registering a
hook inside a traced call would break the graph). The loss is then Hugging Face's
``ForCausalLMLoss`` on those hidden states: labels shifted by one (or ``shift_labels`` as given),
``ignore_index`` (-100), the mean over the tokens not ignored, or the sum over
``num_items_in_batch`` when the Trainer passes it (gradient accumulation); Gemma 2 and 3's
``final_logit_softcapping``; plus ``router_aux_loss_coef x aux_loss`` for Mixtral when the model
returns its router loss. What differs per architecture is a row of :data:`ARCHITECTURES`.

The patch is an instance-level ``forward`` (an object that pickles and deep-copies with the model:
a copy stays patched; :func:`unpatch_lm_loss` undoes it there) and the mark of
:mod:`llmmem.head.marker`; parameters, ``state_dict`` keys, ``generate`` and calls without labels are
untouched. ``inspect.signature(model.forward)`` is the model's own (the Trainer reads it).

Not covered: models whose head is not a plain ``nn.Linear`` (a LoRA-wrapped or quantized head:
refused), a custom ``model.loss_function`` (refused), ``nn.DataParallel`` (its replicas share the
instance ``forward``, which belongs to the original model: use DDP), and the Trainer's
``label_smoothing_factor`` (it takes the labels away from the model and needs the logits: the model
then runs unpatched, as it must).
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
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise TypeError(
            f"patch_lm_loss: {type(model).__name__}.{arch.head} is a {type(head).__name__}, not a plain nn.Linear "
            "(an adapter or a quantized head computes more than weight and bias, which the fused loss would leave out)"
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
    """Forward pre-hook on the head, registered for the patch's life: while armed (``inputs`` a
    list, during a call with labels) it keeps the head's input and gives the head zero rows of it;
    otherwise it leaves the call alone. Registered once rather than per call because registering
    a hook inside ``torch.compile`` breaks the graph, and a hook added to the module's dict while
    tracing is not seen by the traced call at all."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head
        self.inputs: Optional[list] = None

    def __call__(self, module, args):
        if self.inputs is None:
            return None
        x = args[0]
        self.inputs.append(x)
        return (x.narrow(-2, 0, 0),) + tuple(args[1:])

    def attach(self, head: nn.Module) -> None:
        self.head = head
        head.register_forward_pre_hook(self)

    def detach(self) -> None:
        hooks = self.head._forward_pre_hooks
        for key in [k for k, h in hooks.items() if h is self]:
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

    def __init__(self, model: nn.Module, arch: Architecture, chunk_size: Optional[int], prior, capture) -> None:
        self.model = model
        self.arch = arch
        self.chunk_size = chunk_size
        self.prior = prior  # an instance-level forward that was there before (None: the class's)
        self.capture = capture  # the pre-hook on the head
        self.labels_position = _labels_position(self._original(), arch.labels)

    def _call_original(self, *args, **kwargs):
        # called with the model rather than bound to it: torch.compile cannot trace function.__get__
        if self.prior is not None:
            return self.prior(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def _original(self):
        if self.prior is not None:
            return self.prior
        return type(self.model).forward.__get__(self.model, type(self.model))

    @property
    def __signature__(self) -> inspect.Signature:
        # the model's own: the Trainer keeps the dataset columns named in it and reads **kwargs from it
        return inspect.signature(self._original())

    def __call__(self, *args, **kwargs):
        if args and args[0] is self.model:
            # bound to the model as a method (accelerate's unwrap_model(keep_fp32_wrapper=False) rebinds
            # the forward it wrapped so): the model is never an input of its own forward
            args = args[1:]
        original = self._call_original
        name, pos = self.arch.labels, self.labels_position
        if name in kwargs:
            labels = kwargs.pop(name)
        elif pos is not None and len(args) > pos:
            labels, args = args[pos], args[:pos] + (None,) + args[pos + 1 :]
        else:
            labels = None
        if labels is None:
            return original(*args, **kwargs)
        return self._fused(original, labels, args, kwargs)

    def _fused(self, original, labels, args, kwargs):
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
        capture = self.capture
        if capture.head is not head:
            # a new head since the patch (resize_token_embeddings makes one): the hook moves to it; under
            # torch.compile that registration breaks the graph, in this call only (fullgraph=True refuses it)
            capture.detach()
            capture.attach(head)
        capture.inputs = []
        try:
            out = original(*args, **kwargs)
        finally:
            inputs, capture.inputs = capture.inputs, None
        if len(inputs) != 1:
            raise RuntimeError(
                f"patch_lm_loss: {type(model).__name__}'s forward called its head {len(inputs)} times "
                "(expected once); its loss cannot be taken from the head's input"
            )
        loss = self._loss(inputs[0], head, labels, kwargs)
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
        state = "active" if _installed(self.model) is not None else "removed"
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
        forward, or a head that is not a plain ``nn.Linear``.
    :raises ValueError: the model is patched already (patching twice is refused: remove first), or
        its loss function is a custom one.

    Memory: the loss holds one chunk of logits instead of the [tokens x vocabulary] logits, their fp32
    copy and their gradient; the gradients of the hidden states and of the head's weight are
    computed in the forward (see :func:`llmmem.linear_cross_entropy`). Synchronisation: one host
    synchronisation per call on a GPU (the labels' range check). The loss is fp32 whatever the
    model's dtype, as Hugging Face's (llmmem's GPT too), and so is its upstream gradient: fp16 with a
    loss scaler works as it does unpatched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_lm_loss: model must be an nn.Module, got {type(model).__name__}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"patch_lm_loss: chunk_size must be None or an int > 0, got {chunk_size!r}")
    if _installed(model) is not None or fused_head(model) is not None:
        raise ValueError(
            f"patch_lm_loss: this {type(model).__name__} is patched already; call .remove() on the handle the "
            "first patch_lm_loss returned (or llmmem.head.unpatch_lm_loss(model)) before patching it again"
        )
    arch = _architecture(model)
    head = _head(model, arch)
    if arch.hugging_face:
        _check_loss_function(model)
    prior = model.__dict__.get("forward")
    capture = _Capture(head)
    patched = LmLossPatch(model, arch, chunk_size, prior, capture)
    vocab, hidden = head.weight.shape
    info = FusedHead(
        vocab=int(vocab),
        hidden=int(hidden),
        softcap=_softcap(model, arch),
        tied=_is_tied(model, head.weight),
        chunk_size=chunk_size,
    )
    model.forward = patched  # nn.Module.__setattr__: a plain instance attribute (not a module)
    capture.attach(head)
    mark(model, info)
    return PatchHandle(model)


def _installed(model: nn.Module) -> Optional[LmLossPatch]:
    """The patch that is ``model``'s forward (also bound to it as a method), else None."""
    current = model.__dict__.get("forward")
    if isinstance(getattr(current, "__func__", None), LmLossPatch) and current.__self__ is model:
        current = current.__func__
    return current if isinstance(current, LmLossPatch) else None


def _drop_captures(model: nn.Module) -> None:
    """Takes the patch's pre-hook off the head (off any module of ``model`` it is on)."""
    for module in model.modules():
        for key in [k for k, h in module._forward_pre_hooks.items() if isinstance(h, _Capture)]:
            del module._forward_pre_hooks[key]


def unpatch_lm_loss(model: nn.Module, *, missing_ok: bool = False) -> None:
    """Undo :func:`patch_lm_loss` on ``model`` (or on a copy of a patched model): its forward as it
    was before the patch, and no mark.

    :raises ValueError: ``model`` is not patched (unless ``missing_ok``), or its ``forward`` was
        replaced after the patch (by a wrapper that would be lost: remove that one first).
    """
    current = _installed(model) or model.__dict__.get("forward")
    if not isinstance(current, LmLossPatch):
        if fused_head(model) is not None and current is None:  # its forward deleted by hand: only the mark is left
            _drop_captures(model)
            unmark(model)
            return
        if fused_head(model) is not None:
            raise ValueError(
                f"patch_lm_loss: {type(model).__name__}.forward was replaced after patch_lm_loss (now "
                f"{type(current).__name__}); remove that wrapper first, then the patch (accelerate's mixed "
                "precision wrapper: accelerator.unwrap_model(model, keep_fp32_wrapper=False))"
            )
        if missing_ok:
            return
        raise ValueError(f"patch_lm_loss: this {type(model).__name__} is not patched")
    if current.prior is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = current.prior
    current.capture.detach()  # also off a head the model no longer holds
    _drop_captures(model)
    unmark(model)
