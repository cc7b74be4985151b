"""Tokenization and perplexity framing shared by training, the reference and the C++ test.

Perplexity rule (what models/subspace-tiny.expected.json records):
  1. ids = sentencepiece.encode(whole file text)   (no BOS/EOS; the file is read as-is)
  2. split ids into consecutive chunks of (ctx - 1) tokens, the last chunk may be shorter
  3. each window = [BOS] + chunk, so a window has at most ctx tokens
  4. NLL = -log p(window[i] | window[:i]) for i = 1 .. len(window) - 1, i.e. every token of the
     file is predicted exactly once, the first token of each chunk from BOS alone
  5. ppl = exp(sum NLL / number of predicted tokens)
"""
import math

import torch
import torch.nn.functional as F

UNK, BOS, EOS = 0, 1, 2


def encode_file(sp, path):
    with open(path, encoding="utf-8") as f:
        return sp.encode(f.read())


def windows(ids, ctx):
    n = ctx - 1
    return [[BOS] + list(ids[i:i + n]) for i in range(0, len(ids), n)]


@torch.no_grad()
def nll_sum(model, wins, batch=8):
    """Returns (sum of NLL in nats, number of predicted tokens) over the windows. Windows of
    equal length are batched; only the last window of a file can be shorter."""
    total, count = 0.0, 0
    i = 0
    while i < len(wins):
        j = i
        while j < len(wins) and j - i < batch and len(wins[j]) == len(wins[i]):
            j += 1
        x = torch.tensor(wins[i:j], dtype=torch.long, device=next(model.parameters()).device)
        i = j
        if x.shape[1] < 2:
            continue
        logits = model(x[:, :-1]).double()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += x[:, 1:].numel()
    return total, count


def mean_nll(model, wins):
    s, n = nll_sum(model, wins)
    return s / n


def perplexity(model, ids, ctx):
    s, n = nll_sum(model, windows(ids, ctx))
    return math.exp(s / n), s / n, n
