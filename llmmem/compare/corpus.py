"""The text the main job trains on: English-like prose generated from a fixed seed, read as bytes.

Nothing is downloaded: :func:`generate_text` writes the same text on every machine (a small
grammar of sentences over a few hundred words, with paragraphs and dialogue), so every strategy of
``python -m llmmem compare`` and every run of ``examples/train_gpt.py`` sees the same tokens.
``examples/data/corpus.txt`` is this text (``python -m llmmem.compare.corpus > corpus.txt``).

Tokens are bytes (a vocabulary of 256), so no tokenizer is needed and any UTF-8 file works too.
:func:`encode_pairs` reads ASCII text as byte pairs instead, ``256 * b0 + b1`` (a vocabulary of
32,768: the LM-head preset's, ``python -m llmmem compare --preset vocab``).
:class:`BatchSampler` draws random windows of a token sequence with its own generator, whose state
is part of a training checkpoint so that a resumed run sees the batches an uninterrupted one would.
"""

from __future__ import annotations

import random
import sys

__all__ = [
    "generate_text",
    "encode",
    "encode_pairs",
    "TOKENIZERS",
    "BatchSampler",
    "DEFAULT_BYTES",
    "VOCAB_SIZE",
    "PAIR_VOCAB_SIZE",
]

DEFAULT_BYTES = 300_000
VOCAB_SIZE = 256  # byte-level tokens
PAIR_VOCAB_SIZE = 128 * 256  # byte pairs of ASCII text: the first byte < 128

_NAMES = "Ada Bram Cleo Dara Emil Fenna Gus Hana Ivo Juno Kai Lena Milo Nora Otto Pia Rafe Sela Tom Vera".split()
_NOUNS = (
    "river lantern garden window harbor mountain letter engine forest library bridge orchard market "
    "kettle compass violin meadow tower ferry workshop candle village storm archive signal cellar "
    "notebook shepherd bakery clock island sailor map field machine theatre lighthouse road valley"
).split()
_ADJS = (
    "quiet old bright narrow distant small golden heavy gentle broken careful patient silver early "
    "green hollow warm crooked busy calm tall curious rusty wide"
).split()
_VERBS_T = (
    "found carried painted watched mended opened followed built counted crossed remembered answered "
    "measured lifted cleaned visited named guarded described repaired"
).split()
_VERBS_I = "waited laughed slept wandered listened arrived worked sang rested returned whispered".split()
_ADVS = "slowly|quietly|again|early|together|carefully|at last|once more|before dawn|after supper".split("|")
_PLACES = "by the river|near the tower|in the market|under the bridge|at the harbor|behind the orchard".split("|")
_TIMES = "In the morning|Before the storm|On the third day|Late that autumn|When the bells rang|After the rain".split(
    "|"
)
_SAID = "said|asked|replied|answered|whispered".split("|")


def _np(rng: random.Random) -> str:
    noun = rng.choice(_NOUNS)
    return f"the {rng.choice(_ADJS)} {noun}" if rng.random() < 0.6 else f"the {noun}"


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    who = rng.choice(_NAMES)
    if kind < 0.35:
        s = f"{who} {rng.choice(_VERBS_T)} {_np(rng)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(_PLACES)}"
        return s[0].upper() + s[1:] + "."
    if kind < 0.55:
        return f"{rng.choice(_TIMES)}, {who} {rng.choice(_VERBS_I)} {rng.choice(_ADVS)}."
    if kind < 0.7:
        n = rng.randint(2, 12)
        return f"There were {n} {rng.choice(_NOUNS)}s {rng.choice(_PLACES)}, and {_np(rng)} was {rng.choice(_ADJS)}."
    if kind < 0.85:
        other = rng.choice(_NAMES)
        line = f"Have you seen {_np(rng)}?" if rng.random() < 0.5 else f"We {rng.choice(_VERBS_T)} {_np(rng)},"
        return f'"{line}" {who} {rng.choice(_SAID)}, and {other} {rng.choice(_VERBS_I)}.'
    return f"{_np(rng).capitalize()} {rng.choice(_VERBS_T)} {_np(rng)} while {who} {rng.choice(_VERBS_I)}."


def generate_text(n_bytes: int = DEFAULT_BYTES, seed: int = 0) -> str:
    """About ``n_bytes`` of ASCII prose (whole paragraphs, so a little more), the same for a seed."""
    if not isinstance(n_bytes, int) or isinstance(n_bytes, bool) or n_bytes <= 0:
        raise ValueError(f"generate_text: n_bytes must be a positive int, got {n_bytes!r}")
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 8))) + "\n\n"
        parts.append(paragraph)
        size += len(paragraph)
    return "".join(parts)


def encode(text: str):
    """The UTF-8 bytes of ``text`` as a 1-D ``torch.uint8`` tensor (one byte per token)."""
    import torch

    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def encode_pairs(text: str):
    """ASCII ``text`` as byte pairs: token ``256 * b0 + b1`` of each two bytes, in ``[0, 32768)``
    (:data:`PAIR_VOCAB_SIZE`), as a 1-D ``torch.int32`` tensor of ``len(text) // 2`` tokens (an odd
    last byte is dropped). Invertible, and the ids spread over the whole vocabulary: a pair of the
    generated prose is any of 32,768 ids, of which it uses a few hundred.

    :raises ValueError: ``text`` is not ASCII (a first byte >= 128 would leave the vocabulary).
    """
    import torch

    if not text.isascii():
        raise ValueError("encode_pairs: the text must be ASCII (byte pairs of 7-bit text stay below 32768)")
    b = encode(text)[: len(text) // 2 * 2].to(torch.int32).view(-1, 2)
    return b[:, 0] * 256 + b[:, 1]


# tokeniser name (a preset's ``tokens``) -> (encode, vocabulary size)
TOKENIZERS = {"bytes": (encode, VOCAB_SIZE), "pairs": (encode_pairs, PAIR_VOCAB_SIZE)}


class BatchSampler:
    """Random windows of ``tokens`` (1-D): ``next_batch()`` gives ``(x, y)`` of shape
    ``(batch, seq)`` (int64), ``y`` being ``x`` shifted by one token.

    The windows come from a CPU generator seeded with ``seed``; :meth:`state_dict` and
    :meth:`load_state_dict` save and restore it. Data-parallel ranks draw the same global batch
    and each keeps its rows (``rows=slice(...)``), so the union over ranks is what a single
    process would train on.
    """

    def __init__(self, tokens, batch: int, seq: int, seed: int = 0) -> None:
        import torch

        if tokens.dim() != 1 or tokens.numel() < seq + 2:
            raise ValueError(f"BatchSampler: need a 1-D token tensor of at least seq + 2 = {seq + 2} tokens")
        if batch <= 0 or seq <= 0:
            raise ValueError(f"BatchSampler: batch and seq must be positive, got {batch} and {seq}")
        self.tokens, self.batch, self.seq = tokens, batch, seq
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def next_batch(self, batch: int | None = None, rows: slice | None = None):
        import torch

        b = self.batch if batch is None else batch
        starts = torch.randint(0, self.tokens.numel() - self.seq - 1, (b,), generator=self.generator)
        if rows is not None:
            starts = starts[rows]
        offsets = starts[:, None] + torch.arange(self.seq + 1)
        window = self.tokens[offsets].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_BYTES
    sys.stdout.write(generate_text(n))
