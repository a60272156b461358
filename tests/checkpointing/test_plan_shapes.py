"""A plan made for one batch shape meets a larger one (issue 27, item 3, its warning): one warning,
at the user's call of the model, naming the shapes, the bytes and the expected peak against the
budget; none for smaller inputs, none again after the first. Hugging Face Llama (small config);
skipped without ``transformers``."""

from __future__ import annotations

import warnings

from support.planner import lm_batch, tiny_llama, transformers_or_skip

import llmmem

transformers_or_skip()


def _shape_warnings(model, batch) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**batch).loss.backward()
    return [w for w in caught if "plan was made for" in str(w.message)]


def test_a_larger_batch_is_warned_once_with_the_expected_peak_and_a_smaller_one_not():
    model = tiny_llama("eager", layers=4, dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = llmmem.auto_checkpoint(model, budget=0.5, sample=lm_batch(seq=32), repeats=0)
    assert _shape_warnings(model, lm_batch(seq=16)) == []
    (w,) = _shape_warnings(model, lm_batch(seq=64))
    text = str(w.message)
    assert "[2, 64, " in text and "2.00x as large" in text and "budget" in text, text
    assert w.filename == __file__  # at the call of the model, not inside llmmem or transformers
    assert _shape_warnings(model, lm_batch(seq=64)) == [] and _shape_warnings(model, lm_batch(seq=96)) == []
    plan.remove()
