"""Data the lab uses: nothing is downloaded.

* scikit-learn's handwritten digits (1797 8x8 images, shipped inside the sklearn wheel);
* a generated variable-length sequence task with heavy padding;
* characters of the Python standard library's own source files (they ship with Python).
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch
from torch import Tensor

PAD = 0


@functools.lru_cache(maxsize=1)
def digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_test, y_test): images (N, 1, 8, 8) standardized with the training
    set's mean and std; a fixed split of 1347 train / 450 test."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - the extra is declared
        raise ImportError("normscope lab needs scikit-learn: pip install 'normscope[lab]'") from err
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    test, train = perm[:450], perm[450:]
    mu, sd = x[train].mean(), x[train].std()
    x = (x - mu) / sd
    return x[train], y[train], x[test], y[test]


def padded_sequences(n: int, seed: int, max_len: int = 64, vocab: int = 12, min_len: int = 2,
                     long_len: int = 48) -> tuple[Tensor, Tensor, Tensor]:
    """A sequence classification task where most positions are padding.

    Tokens 1..vocab-1, ``PAD = 0`` after the end. The label says whether token 1 occurs more
    often than token 2. Lengths are drawn log-uniformly in [min_len, long_len], so batches mix
    very short and long sequences and the fraction of padding varies a lot from batch to batch
    (about 70% of all positions are padding).

    Returns (tokens (n, max_len) long, mask (n, max_len) bool -- True = real token, labels (n,)).
    """
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    lengths = torch.exp(math.log(min_len) + u * (math.log(long_len) - math.log(min_len))).round().long()
    tokens = torch.randint(1, vocab, (n, max_len), generator=g)
    pos = torch.arange(max_len)[None, :]
    mask = pos < lengths[:, None]
    tokens = tokens.masked_fill(~mask, PAD)
    labels = ((tokens == 1).sum(1) > (tokens == 2).sum(1)).long()
    return tokens, mask, labels


@functools.lru_cache(maxsize=4)
def stdlib_text(n_chars: int) -> bytes:
    """The first ``n_chars`` ASCII bytes of the standard library's top-level ``*.py`` files, in
    sorted file-name order (deterministic on a given Python version)."""
    root = Path(os.__file__).parent
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        out += bytes(b if b < 128 else ord("?") for b in data)
        if len(out) >= n_chars:
            break
    if len(out) < 1000:
        raise RuntimeError(f"stdlib_text: found only {len(out)} bytes of source under {root}")
    return bytes(out[:n_chars])


def char_splits(n_chars: int) -> tuple[Tensor, Tensor]:
    """(train, val) byte tensors: the last 10% of the text is validation."""
    data = torch.tensor(list(stdlib_text(n_chars)), dtype=torch.long)
    cut = int(len(data) * 0.9)
    return data[:cut], data[cut:]


def char_batch(data: Tensor, batch: int, seq: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def unigram_entropy(data: Tensor, vocab: int = 128) -> float:
    """Entropy (nats) of the byte distribution: the loss of a model that learned nothing but
    character frequencies -- the line below which a language model has learned something."""
    p = torch.bincount(data, minlength=vocab).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())
