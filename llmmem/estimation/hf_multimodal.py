"""Multimodal Hugging Face configs (LLaVA, Qwen2-VL, Gemma 3, PaliGemma, Idefics, mllama, audio
language models ...), refused by name: the estimator's layer model describes the language model
only, and reading such a config through its ``text_config`` would leave out the vision (or audio)
tower's parameters, state and activations without a word.

Pure Python, like :mod:`llmmem.estimation.hf_moe`: reads a config's ``to_dict()`` (or a
``config.json``); imports neither transformers nor torch nor the rest of the estimator.

What is still read: the text model alone, given as such (``config.text_config``, a
``*ForCausalLM`` built from it), whose config holds no tower.
"""

from __future__ import annotations

__all__ = ["refuse_towers"]

# Sub-configs of a non-text tower, as transformers names them (its configs' ``sub_configs``); a
# tower's key present and not None is a tower in the model. Not ``encoder_config`` / ``decoder``:
# those are the two stacks of text encoder-decoders, refused elsewhere as such.
_TOWERS = {
    "vision_config": "vision",
    "high_res_vision_config": "vision",
    "image_config": "vision",
    "vq_config": "image tokenizer (VQ-VAE)",
    "qformer_config": "vision (Q-Former)",
    "perceiver_config": "vision (perceiver resampler)",
    "video_config": "video",
    "audio_config": "audio",
    "audio_encoder_config": "audio",
    "speech_config": "speech",
}


def refuse_towers(model_type: str, raw: dict) -> None:
    """ValueError naming ``model_type`` and its towers for a config that holds a vision, audio or
    other non-text tower beside its text model; nothing for any other config."""
    found = [key for key in _TOWERS if raw.get(key) is not None]
    if not found:
        return
    towers = ", ".join(f"{'an' if _TOWERS[k][0] in 'aeiou' else 'a'} {_TOWERS[k]} tower ({k})" for k in found)
    text = " beside its text model (text_config)" if raw.get("text_config") is not None else ""
    raise ValueError(
        f"model: a Hugging Face config of model_type {model_type!r}, a multimodal model with {towers}{text}: the "
        "estimator does not estimate the tower, and does not give the text model's numbers for the whole model; "
        "to estimate the language model alone, pass its text config (config.text_config) or a *ForCausalLM built "
        "from it"
    )
