"""Bad input to llmmem.linear_cross_entropy: each a clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

import llmmem


def _ok():
    return torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))


@pytest.mark.parametrize(
    "change,exc,words",
    [
        (lambda h, w, y, kw: (h, torch.randn(10, 9), y, kw), ValueError, "last dimension"),
        (lambda h, w, y, kw: (h, w, torch.randint(0, 10, (5,)), kw), ValueError, "labels' shape"),
        (lambda h, w, y, kw: (h, w, y.int(), kw), TypeError, "int64"),
        (lambda h, w, y, kw: (h, w.double(), y, kw), TypeError, "must match"),
        (lambda h, w, y, kw: (h.long(), w, y, kw), TypeError, "float32, bfloat16 or float16"),
        (lambda h, w, y, kw: (h, w, y, {"reduction": "avg"}), ValueError, "reduction"),
        (lambda h, w, y, kw: (h, w, y, {"label_smoothing": 1.5}), ValueError, "label_smoothing"),
        (lambda h, w, y, kw: (h, w, y, {"label_smoothing": -0.1}), ValueError, "label_smoothing"),
        (lambda h, w, y, kw: (h, w, y, {"chunk_size": 0}), ValueError, "chunk_size"),
        (lambda h, w, y, kw: (h, w, y, {"softcap": 0.0}), ValueError, "softcap"),
        (lambda h, w, y, kw: (h, w, y, {"softcap": -3.0}), ValueError, "softcap"),
        (lambda h, w, y, kw: (h, w, y, {"bias": torch.randn(9)}), ValueError, "bias"),
        (lambda h, w, y, kw: (h, w, y, {"bias": torch.randn(10).double()}), TypeError, "bias"),
        (lambda h, w, y, kw: (h, torch.randn(10), y, kw), ValueError, "weight"),
        (lambda h, w, y, kw: ("h", w, y, kw), TypeError, "hidden"),
    ],
)
def test_bad_input(change, exc, words):
    h, w, y, kw = change(*_ok(), {})
    with pytest.raises(exc, match=words):
        llmmem.linear_cross_entropy(h, w, y, **kw)


@pytest.mark.parametrize("label", [10, -1, 1000])
def test_a_label_outside_the_vocabulary_is_an_index_error_as_in_torch(label):
    h, w, y = _ok()
    y[2] = label
    with pytest.raises(IndexError, match=str(label)):
        llmmem.linear_cross_entropy(h, w, y)
    with pytest.raises(IndexError):
        torch.nn.functional.cross_entropy(h @ w.t(), y)
