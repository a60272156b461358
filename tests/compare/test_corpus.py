"""The generated corpus and the batch sampler: the same tokens and batches everywhere."""

from __future__ import annotations

import pathlib

import pytest
import torch

from llmmem.compare.corpus import DEFAULT_BYTES, PAIR_VOCAB_SIZE, BatchSampler, encode, encode_pairs, generate_text

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_text_is_deterministic_ascii_prose():
    a, b = generate_text(20_000, seed=3), generate_text(20_000, seed=3)
    assert a == b and len(a) >= 20_000
    assert a != generate_text(20_000, seed=4)
    assert a.isascii() and a.count("\n\n") > 10 and a.count(".") > 100


def test_shipped_corpus_is_the_generated_text():
    shipped = (ROOT / "examples" / "data" / "corpus.txt").read_text(encoding="utf-8")
    assert shipped == generate_text(DEFAULT_BYTES)


def test_sampler_windows_are_shifted_by_one_and_reproducible():
    tokens = encode(generate_text(5000))
    s1, s2 = BatchSampler(tokens, 3, 16, seed=1), BatchSampler(tokens, 3, 16, seed=1)
    x, y = s1.next_batch()
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = s2.next_batch()
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_sampler_state_round_trip_and_rows():
    tokens = encode(generate_text(5000))
    s = BatchSampler(tokens, 4, 8, seed=0)
    s.next_batch()
    state = s.state_dict()
    want = s.next_batch()
    s.load_state_dict(state)
    got = s.next_batch()
    assert torch.equal(want[0], got[0])
    # data-parallel ranks each keep their rows of the same global batch
    full = BatchSampler(tokens, 4, 8, seed=5).next_batch()[0]
    halves = [BatchSampler(tokens, 4, 8, seed=5).next_batch(rows=slice(r * 2, r * 2 + 2))[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), full)


def test_byte_pairs_are_tokens_of_a_32k_vocabulary():
    text = generate_text(5000)
    text = text[: len(text) // 2 * 2]
    pairs = encode_pairs(text + "x")  # an odd last byte is dropped
    assert pairs.shape == (len(text) // 2,) and pairs.dtype == torch.int32
    b = encode(text)
    assert torch.equal(pairs, b[0::2].int() * 256 + b[1::2].int())
    assert PAIR_VOCAB_SIZE == 32768 and int(pairs.max()) < PAIR_VOCAB_SIZE and int(pairs.max()) > 256
    tokens = BatchSampler(pairs, 2, 8, seed=0).next_batch()[0]
    assert tokens.dtype == torch.int64
    with pytest.raises(ValueError, match="ASCII"):
        encode_pairs("caf\u00e9")


def test_bad_input():
    with pytest.raises(ValueError, match="n_bytes"):
        generate_text(0)
    with pytest.raises(ValueError, match="seq"):
        BatchSampler(encode("short"), 2, 16)
