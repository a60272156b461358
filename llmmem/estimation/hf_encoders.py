"""The Hugging Face encoder-decoders (T5, mT5, BART, mBART) and encoders with a task head (BERT,
RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT, ViT) as fields of
:class:`llmmem.estimation.model_configs.ModelConfig`.

Pure Python: reads a config object (or a ``config.json`` read as one) and returns a dict of
fields; neither transformers nor torch is imported, and this module imports nothing of the
estimator (``model_configs`` builds the config from what it returns).

The task head decides what the model has past its layers (element counts, ``h`` hidden, ``V``
vocabulary, ``n`` labels):

=========================  ==============================================================  ========
task                       head                                                            from
=========================  ==============================================================  ========
``seq2seq-lm``             the vocabulary head (tied to the shared embedding, or ``V·h``)   T5, BART
``masked-lm``              dense ``h·h + h``, LayerNorm ``2h``, the tied decoder, bias ``V``  encoders
``sequence-classification`` dense ``h·h + h`` (BERT's pooler, RoBERTa's and DistilBERT's     encoders
                           first classifier layer), classifier ``n·h + n``
``token-classification``   classifier ``n·h + n``                                           encoders
``question-answering``     ``qa_outputs`` ``n·h + n`` on every token (``n`` = 2: start, end)  BERT-style
``image-classification``   classifier ``n·h + n`` (ViT: no pooler)                          ViT
=========================  ==============================================================  ========

A model class names its task (:func:`task_of_class`); a bare config is read for the task of the
first class in its ``architectures``, else the default of its family: ``seq2seq-lm`` for an
encoder-decoder, ``image-classification`` for ViT, ``sequence-classification`` for a text encoder.
An encoder-decoder's encoder-only class (``T5EncoderModel``) is refused (:func:`refuse_class`): the
estimator reads both stacks or none.
"""

from __future__ import annotations

__all__ = [
    "ENCODER_DECODER_TYPES",
    "ENCODER_TYPES",
    "TASKS",
    "task_of_class",
    "default_task",
    "encoder_fields",
    "refuse_class",
]

ENCODER_DECODER_TYPES = frozenset(("t5", "mt5", "bart", "mbart"))
_BERT_TYPES = frozenset(("bert", "roberta", "xlm-roberta", "camembert"))
ENCODER_TYPES = _BERT_TYPES | {"distilbert", "vit"}

TASKS = (
    "causal-lm",
    "seq2seq-lm",
    "masked-lm",
    "sequence-classification",
    "token-classification",
    "image-classification",
    "question-answering",
)
# the end of a Hugging Face model class's name -> the task its head serves
_CLASS_TASKS = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForConditionalGeneration", "seq2seq-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("ForSequenceClassification", "sequence-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForImageClassification", "image-classification"),
    ("ForQuestionAnswering", "question-answering"),
)


def task_of_class(name: str) -> str | None:
    """The task of a Hugging Face model class by its name (``BertForSequenceClassification``:
    ``"sequence-classification"``), or None for a class that names none (``BertModel``)."""
    for suffix, task in _CLASS_TASKS:
        if name.endswith(suffix):
            return task
    return None


def refuse_class(name: str, model_type: str) -> None:
    """ValueError naming the class for an encoder-only class of an encoder-decoder model type
    (``T5EncoderModel``: one stack, no head), which the estimator would otherwise read as the whole
    encoder-decoder (both stacks, cross-attention, a vocabulary head); nothing for another class."""
    if model_type in ENCODER_DECODER_TYPES and name.endswith("EncoderModel"):
        raise ValueError(
            f"model: a {name}, the encoder alone of the encoder-decoder model_type {model_type!r}: the estimator "
            "reads this family with both stacks and its head (a *ForConditionalGeneration) only, and does not "
            "guess the encoder's memory from it"
        )
    if model_type in ENCODER_DECODER_TYPES | ENCODER_TYPES and task_of_class(name) is None:
        raise ValueError(
            f"model: a {name} of model_type {model_type!r} has no task head the estimator reads (it reads this "
            f"family with one: {', '.join(t for t in TASKS if t != 'causal-lm')}); estimate the model with its head "
            "(BertForSequenceClassification, T5ForConditionalGeneration, ...) rather than a guess at a headless one"
        )


def default_task(model_type: str, raw: dict) -> str:
    """The task of a bare config: its first ``architectures`` class's, else its family's default."""
    names = raw.get("architectures") or []
    for name in names if isinstance(names, (list, tuple)) else []:
        task = task_of_class(str(name))
        if task is not None:
            return task
    if model_type in ENCODER_DECODER_TYPES:
        return "seq2seq-lm"
    if model_type == "vit":
        return "image-classification"
    return "sequence-classification"


def _labels(config, raw: dict) -> int:
    """``num_labels``: a property of Hugging Face's config objects (from ``id2label``), a key of a
    config.json only through ``id2label``."""
    n = getattr(config, "num_labels", None)
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        return n
    labels = raw.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else 2


def _head_tensors(task: str, h: int, vocab: int, labels: int) -> list[int]:
    """Element counts of a task head's own tensors (a tied vocabulary matrix is the embedding's)."""
    classifier = [labels * h, labels]
    if task == "masked-lm":
        return [h * h, h, h, h, vocab]  # transform dense, its LayerNorm, the decoder's bias
    if task == "sequence-classification":
        return [h * h, h] + classifier
    if task in ("token-classification", "image-classification", "question-answering"):
        return classifier
    return []


def _refuse(model_type: str, what: str) -> None:
    raise ValueError(
        f"model: a Hugging Face config of model_type {model_type!r} with {what}: the estimator reads this family "
        "without it only, and does not guess"
    )


def encoder_fields(config, raw: dict, task: str | None, activations: dict) -> dict | None:
    """The fields of a ModelConfig for a T5 / BART / BERT-style / DistilBERT / ViT config, or None
    for another model type. ``task``: None for :func:`default_task`; ``activations``: Hugging
    Face's activation names -> the estimator's. ValueError naming the field for a variant the
    estimator does not read (BERT's relative position embeddings, a BART whose decoder differs
    from its encoder in width or heads, a task the family has no head for)."""
    model_type = str(raw.get("model_type") or getattr(config, "model_type", "") or "")
    if model_type not in ENCODER_DECODER_TYPES and model_type not in ENCODER_TYPES:
        return None
    if model_type in _BERT_TYPES and raw.get("is_decoder"):
        return None  # BERT configured as a causal decoder (BertLMHeadModel): the decoder reader's
    task = default_task(model_type, raw) if task is None else task
    allowed = (
        ("seq2seq-lm",)
        if model_type in ENCODER_DECODER_TYPES
        else ("image-classification",)
        if model_type == "vit"
        else ("masked-lm", "sequence-classification", "token-classification")
        # DistilBERT's question answering has a dropout of its own (qa_dropout) before its head: not read
        + (("question-answering",) if model_type in _BERT_TYPES else ())
    )
    if task not in allowed:
        raise ValueError(
            f"task: {task!r} is not a head of model_type {model_type!r}; the estimator reads {', '.join(allowed)}"
        )
    labels = _labels(config, raw)
    if model_type in ("t5", "mt5"):
        fields = _t5(raw, activations)
    elif model_type in ("bart", "mbart"):
        fields = _bart(model_type, raw, activations)
    elif model_type == "distilbert":
        fields = _distilbert(raw, activations)
    elif model_type == "vit":
        fields = _vit(raw, activations)
    else:
        fields = _bert(model_type, raw, activations)
    h, vocab = fields["hidden"], fields["vocab"]
    fields["extra_tensors"] = tuple(fields.get("extra_tensors", ()) + tuple(_head_tensors(task, h, vocab, labels)))
    fields.update(task=task, num_labels=labels)
    return fields


def _t5(raw: dict, activations: dict) -> dict:
    # T5 (Raffel et al. 2020): pre-norm RMS "T5LayerNorm" written from elementwise operators, no
    # biases, relative position buckets (one table a stack, in its first layer), heads of d_kv not
    # hidden/heads; "gated-gelu" (FLAN-T5, mT5) is a gated MLP of gelu_new; dropout_rate everywhere
    # (embeddings, attention probabilities, residual branches, the MLP's hidden and each stack's end)
    proj = str(raw.get("feed_forward_proj") or "relu")
    gated = proj.startswith("gated-")
    act = proj.split("-")[-1]
    act = "gelu_new" if act == "gelu" and gated else act  # what T5Config sets for "gated-gelu"
    p = float(raw.get("dropout_rate") or 0.0)
    layers = int(raw.get("num_layers") or 6)
    heads, buckets = int(raw.get("num_heads") or 8), int(raw.get("relative_attention_num_buckets") or 32)
    return dict(
        architecture="encoder-decoder",
        layers=layers,
        decoder_layers=int(raw.get("num_decoder_layers") or layers),
        hidden=int(raw.get("d_model") or 512),
        heads=heads,
        head_dim=int(raw.get("d_kv") or 64),
        ffn=int(raw.get("d_ff") or 2048),
        vocab=int(raw.get("vocab_size") or 32128),
        mlp="swiglu" if gated else "gelu",
        activation=activations.get(act, "gelu"),
        norm="rmsnorm",
        fused_norm=False,
        positions="relative",
        bias=False,
        tied_embeddings=bool(raw.get("tie_word_embeddings", True)),
        dropout=p,
        attention_dropout=p,
        hidden_dropout=p,
        activation_dropout=p,
        extra_tensors=(buckets * heads, buckets * heads),  # the encoder's and the decoder's bucket tables
    )


def _bart(model_type: str, raw: dict, activations: dict) -> dict:
    # BART (Lewis et al. 2019) / mBART: post-norm (mBART pre-norm with a final LayerNorm a stack),
    # learned positions with 2 offset rows, a LayerNorm on each stack's embeddings, biases everywhere
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if raw.get(enc) != raw.get(dec):
            _refuse(model_type, f"{dec} {raw.get(dec)} unlike {enc} {raw.get(enc)}")
    h = int(raw.get("d_model") or 1024)
    return dict(
        architecture="encoder-decoder",
        layers=int(raw.get("encoder_layers") or 12),
        decoder_layers=int(raw.get("decoder_layers") or 12),
        hidden=h,
        heads=int(raw.get("encoder_attention_heads") or 16),
        ffn=int(raw.get("encoder_ffn_dim") or 4096),
        vocab=int(raw.get("vocab_size") or 50265),
        mlp="gelu",
        activation=activations.get(str(raw.get("activation_function") or "gelu"), "gelu"),
        norm="layernorm",
        positions="learned",
        max_positions=int(raw.get("max_position_embeddings") or 1024) + 2,
        bias=True,
        tied_embeddings=bool(raw.get("tie_word_embeddings", True)),
        dropout=float(raw.get("dropout") or 0.0),
        hidden_dropout=float(raw.get("dropout") or 0.0),
        attention_dropout=float(raw.get("attention_dropout") or 0.0),
        activation_dropout=float(raw.get("activation_dropout") or 0.0),
        extra_tensors=(h, h, h, h) if model_type == "mbart" else (),  # mBART's final LayerNorms
    )


def _bert(model_type: str, raw: dict, activations: dict) -> dict:
    # BERT (Devlin et al. 2019) and RoBERTa: post-norm, learned absolute positions, token types, a
    # LayerNorm on the embeddings (counted where a pre-norm model's final norm is)
    kind = raw.get("position_embedding_type") or "absolute"
    if kind != "absolute":
        _refuse(model_type, f"position_embedding_type {kind!r}")
    h = int(raw.get("hidden_size") or 768)
    types = int(raw.get("type_vocab_size") or 0)
    return dict(
        architecture="encoder",
        layers=int(raw.get("num_hidden_layers") or 12),
        hidden=h,
        heads=int(raw.get("num_attention_heads") or 12),
        ffn=int(raw.get("intermediate_size") or 4 * h),
        vocab=int(raw.get("vocab_size") or 30522),
        mlp="gelu",
        activation=activations.get(str(raw.get("hidden_act") or "gelu"), "gelu"),
        norm="layernorm",
        positions="learned",
        max_positions=int(raw.get("max_position_embeddings") or 512),
        bias=True,
        tied_embeddings=bool(raw.get("tie_word_embeddings", True)),
        dropout=float(raw.get("hidden_dropout_prob") or 0.0),
        hidden_dropout=float(raw.get("hidden_dropout_prob") or 0.0),
        attention_dropout=float(raw.get("attention_probs_dropout_prob") or 0.0),
        extra_tensors=(types * h,) if types else (),
    )


def _distilbert(raw: dict, activations: dict) -> dict:
    # DistilBERT (Sanh et al. 2019): BERT's layer under other names, no token types
    h = int(raw.get("dim") or 768)
    return dict(
        architecture="encoder",
        layers=int(raw.get("n_layers") or 6),
        hidden=h,
        heads=int(raw.get("n_heads") or 12),
        ffn=int(raw.get("hidden_dim") or 4 * h),
        vocab=int(raw.get("vocab_size") or 30522),
        mlp="gelu",
        activation=activations.get(str(raw.get("activation") or "gelu"), "gelu"),
        norm="layernorm",
        positions="learned",
        max_positions=int(raw.get("max_position_embeddings") or 512),
        bias=True,
        tied_embeddings=bool(raw.get("tie_word_embeddings", True)),
        dropout=float(raw.get("dropout") or 0.0),
        hidden_dropout=float(raw.get("dropout") or 0.0),
        attention_dropout=float(raw.get("attention_dropout") or 0.0),
    )


def _vit(raw: dict, activations: dict) -> dict:
    # ViT (Dosovitskiy et al. 2021): pre-norm, (image / patch)^2 patches and a class token, each a
    # learned position; the patches embedded by a convolution of patch x patch x channels per output
    h = int(raw.get("hidden_size") or 768)
    image, patch = int(raw.get("image_size") or 224), int(raw.get("patch_size") or 16)
    channels = int(raw.get("num_channels") or 3)
    tokens = (image // patch) ** 2 + 1
    return dict(
        architecture="encoder",
        layers=int(raw.get("num_hidden_layers") or 12),
        hidden=h,
        heads=int(raw.get("num_attention_heads") or 12),
        ffn=int(raw.get("intermediate_size") or 4 * h),
        vocab=0,
        mlp="gelu",
        activation=activations.get(str(raw.get("hidden_act") or "gelu"), "gelu"),
        norm="layernorm",
        positions="learned",
        max_positions=tokens,
        image_tokens=tokens,
        bias=True,
        dropout=float(raw.get("hidden_dropout_prob") or 0.0),
        hidden_dropout=float(raw.get("hidden_dropout_prob") or 0.0),
        attention_dropout=float(raw.get("attention_probs_dropout_prob") or 0.0),
        extra_tensors=(h * channels * patch * patch, h, h),  # the patch convolution and its bias, the class token
    )
