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


@functools.lru_cache(maxsize=2)
def cluttered_digits(size: int = 16, noise: float = 0.5, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A harder digits task, still generated from sklearn's digits (nothing downloaded): each 8x8
    digit is pasted at a random position on a ``size`` x ``size`` canvas and Gaussian pixel noise
    of std ``noise`` (in units of the standardized digits) is added. The placement and the noise
    are drawn once (fixed ``seed``), so train and test are fixed sets: (N, 1, size, size)."""
    xtr, ytr, xte, yte = digits()
    g = torch.Generator().manual_seed(seed)

    def paste(x: Tensor) -> Tensor:
        n = len(x)
        out = torch.zeros(n, 1, size, size)
        ij = torch.randint(0, size - 8 + 1, (n, 2), generator=g)
        for k in range(n):
            i, j = int(ij[k, 0]), int(ij[k, 1])
            out[k, :, i:i + 8, j:j + 8] = x[k] - x[k].min()  # background 0 on the canvas
        out = out + noise * torch.randn(out.shape, generator=g)
        return out

    a, b = paste(xtr), paste(xte)
    mu, sd = a.mean(), a.std()
    return (a - mu) / sd, ytr, (b - mu) / sd, yte


@functools.lru_cache(maxsize=4)
def word_sentences(n_chars: int, vocab_words: int, max_len: int = 32
                   ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor], int]:
    """Word-level "sentences" of variable length: the non-empty lines of the standard library's
    source (:func:`stdlib_text`), split into words and punctuation, the ``vocab_words`` most
    frequent kept (id 1 = unknown word, 0 = pad), lines of 2..``max_len`` words. Returns
    ((train tokens, train mask), (val tokens, val mask), vocabulary size); the last 10% of the
    lines are validation."""
    import collections
    import re

    lines = [re.findall(r"\w+|[^\w\s]", ln) for ln in stdlib_text(n_chars).decode("ascii").splitlines()]
    lines = [ln[:max_len] for ln in lines if len(ln) >= 2]
    counts = collections.Counter(w for ln in lines for w in ln)
    ids = {w: i + 2 for i, (w, _) in enumerate(counts.most_common(vocab_words))}
    tok = torch.zeros(len(lines), max_len, dtype=torch.long)
    for i, ln in enumerate(lines):
        tok[i, : len(ln)] = torch.tensor([ids.get(w, 1) for w in ln])
    mask = torch.arange(max_len)[None, :] < torch.tensor([len(ln) for ln in lines])[:, None]
    cut = int(len(lines) * 0.9)
    return (tok[:cut], mask[:cut]), (tok[cut:], mask[cut:]), vocab_words + 2
