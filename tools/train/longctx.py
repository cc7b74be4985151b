"""Seeded long-range documents: what the long-context model trains on and is evaluated with.

Three kinds of document need context from far back to predict their last tokens:
  * pass key -- a number buried in filler at a chosen depth, asked for at the end. The filler and
    wording are those of Mohtashami & Jaggi's landmark-attention pass-key test; a second
    variant hides the key in natural text instead of the repeated filler.
  * key-value recall -- a list of N "key K: V" lines, then questions about some of the keys.
  * recurrence -- natural text in which earlier passages recur verbatim later on (copying from
    far back: what induction heads do).
  * random repeat -- a run of random tokens that recurs, with natural text between: nothing but
    copying predicts it, so the copying circuit forms fast (training only).
  * far copy -- a passage that recurs once, anywhere from right after itself to the far end of
    the window (training only): the long model of round two copied its own formats but lost
    text from elsewhere past ~300 tokens, the gap its random repeats were limited to.
Training mixes them with plain natural text (`Mixer`); the evaluation suite draws them from the
held-out test split with its own seed (`tools/train/longctx_suite.py`). Every generator takes a
numpy Generator, so the same seed gives the same documents.
"""
import numpy as np

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                 "memorize them. I will quiz you about the important information there.")
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
                  "back again.")
PASSKEY_QUESTION = "What is the pass key? The pass key is"
KV_INTRO = "Here is a list of keys and their values. Remember them."


def passkey_line(key):
    return "The pass key is %s. Remember it. %s is the pass key." % (key, key)


def random_digits(rng, n):
    first = str(int(rng.integers(1, 10)))
    return first + "".join(str(int(d)) for d in rng.integers(0, 10, size=n - 1))


class Texts:
    """Natural text of one split as token ids, with a way to cut a span of it as text."""

    def __init__(self, sp, ids):
        self.sp = sp
        self.ids = np.asarray(ids, dtype=np.int64)

    def span_ids(self, rng, n):
        o = int(rng.integers(0, len(self.ids) - n - 1))
        return self.ids[o:o + n]

    def span_text(self, rng, n):
        return self.sp.decode(self.span_ids(rng, n).tolist())


def _fit(sp, build, n_tokens, units):
    """Largest `units` <= the estimate for which build(units) encodes to <= n_tokens tokens."""
    while units > 0:
        text = build(units)
        ids = sp.encode(text)
        if len(ids) <= n_tokens:
            return text, ids, units
        units = max(0, int(units * n_tokens / len(ids)) - 1) if len(ids) > n_tokens * 1.05 \
            else units - 1
    text = build(0)
    return text, sp.encode(text), 0


def passkey(sp, texts, rng, n_tokens, depth, haystack="filler", key_digits=5):
    """A pass-key prompt of at most n_tokens tokens (answer excluded) with the key line at
    `depth` (0 = right after the intro, 1 = right before the question).
    Returns dict(prompt, answer, ...) where answer is " <key>." 's digits: " 71432"."""
    key = random_digits(rng, key_digits)
    line = passkey_line(key)
    if haystack == "filler":
        per = len(sp.encode(PASSKEY_FILLER)) + 1

        def build(units):
            a = int(round(depth * units))
            before = " ".join([PASSKEY_FILLER] * a)
            after = " ".join([PASSKEY_FILLER] * (units - a))
            parts = [PASSKEY_INTRO, before, line, after, PASSKEY_QUESTION]
            return " ".join(p for p in parts if p)
        fixed = len(sp.encode(build(0)))
        text, ids, _ = _fit(sp, build, n_tokens, max(0, (n_tokens - fixed) // per + 1))
    else:
        fixed = len(sp.encode(" ".join([PASSKEY_INTRO, line, PASSKEY_QUESTION])))
        hay = texts.span_text(rng, max(1, n_tokens - fixed + 16)).replace("\n", " ")
        words = hay.split(" ")

        def build(units):
            w = words[:units]
            a = int(round(depth * len(w)))
            parts = [PASSKEY_INTRO, " ".join(w[:a]), line, " ".join(w[a:]), PASSKEY_QUESTION]
            return " ".join(p for p in parts if p)
        text, ids, _ = _fit(sp, build, n_tokens, len(words))
    return {"kind": "passkey_" + haystack, "prompt": text, "answer": " " + key,
            "depth": depth, "n_tokens": len(ids)}


def kv_recall(sp, rng, n_tokens, n_queries=1, pairs=None):
    """Key-value lines, then n_queries questions; the prompt ends inside the last question.
    With `pairs` the list has that many lines, else as many as fit in n_tokens.
    Returns dict(prompt, answer) with answer " <value>"."""
    def line(k, v):
        return "key %s: %s" % (k, v)

    per = len(sp.encode(line("1234", "12345"))) + 1
    fixed_q = len(sp.encode("What is the value of key 1234? The value of key 1234 is 12345.")) + 1
    est = pairs or max(1, (n_tokens - 16 - n_queries * fixed_q) // per)
    keys, vals, seen = [], [], set()
    while len(keys) < est + 64:
        k = random_digits(rng, 4)
        if k not in seen:
            seen.add(k)
            keys.append(k)
            vals.append(random_digits(rng, 5))
    q_seed = int(rng.integers(0, 2**31))
    asked = {}

    def build(units):
        units = max(1, units)
        q = np.random.default_rng(q_seed).choice(units, size=min(n_queries, units), replace=False)
        body = "\n".join(line(keys[i], vals[i]) for i in range(units))
        qs = ["What is the value of key %s? The value of key %s is %s." % (keys[i], keys[i],
                                                                            vals[i])
              for i in q[:-1]]
        qs.append("What is the value of key %s? The value of key %s is" % (keys[q[-1]],
                                                                           keys[q[-1]]))
        asked["last"], asked["units"] = int(q[-1]), units
        return KV_INTRO + "\n" + body + "\n" + "\n".join(qs)

    if pairs:
        text = build(pairs)
        ids = sp.encode(text)
    else:
        text, ids, _ = _fit(sp, build, n_tokens, est)
        text = build(asked["units"])  # _fit may stop at 0; build() clamps to one pair
        ids = sp.encode(text)
    last, units = asked["last"], asked["units"]
    return {"kind": "kv", "prompt": text, "answer": " " + vals[last], "pairs": units,
            "depth": last / max(1, units - 1), "n_tokens": len(ids)}


def recurrence_ids(texts, rng, n_tokens, min_len=16, max_len=128):
    """Token ids of natural text in which earlier spans recur verbatim. Returns (ids, mask)
    where mask marks the tokens that are copies of something earlier (the 2nd occurrence)."""
    out, mask = [], []
    while len(out) < n_tokens:
        if len(out) >= 2 * min_len and rng.random() < 0.5:
            m = int(rng.integers(min_len, max_len + 1))
            m = min(m, len(out) // 2)
            s = int(rng.integers(0, len(out) - m + 1))
            out.extend(out[s:s + m])
            mask.extend([1] * m)
        else:
            m = int(rng.integers(32, 384))
            out.extend(texts.span_ids(rng, m).tolist())
            mask.extend([0] * m)
    return out[:n_tokens], mask[:n_tokens]


def random_repeat_ids(texts, rng, n_tokens, vocab_size, first_id=3, run_len=(16, 256),
                      max_gap=256, alphabets=None):
    """A run of random token ids (ids >= first_id: no control tokens; drawn from a random
    subset of `alphabets` sizes when given) that recurs 2-4 times, natural text between the
    copies, cut to n_tokens."""
    out = []
    while len(out) < n_tokens:
        m = int(rng.integers(run_len[0], run_len[1] + 1))
        if alphabets:
            size = int(alphabets[int(rng.integers(0, len(alphabets)))])
            symbols = rng.choice(np.arange(first_id, vocab_size), size=size, replace=False)
            run = rng.choice(symbols, size=m).tolist()
        else:
            run = rng.integers(first_id, vocab_size, size=m).tolist()
        for _ in range(int(rng.integers(2, 5))):
            out.extend(run)
            gap = int(rng.integers(0, max_gap + 1))
            if gap:
                out.extend(texts.span_ids(rng, gap).tolist())
    return out[:n_tokens]


def passage_repeat_ids(texts, rng, n_tokens, run_len=(12, 48), max_gap=16):
    """A short natural passage that recurs 2-4 times with a little natural text between the
    copies, cut to n_tokens: the induction-head curriculum on tokens whose embeddings the
    model already knows (random ids are rare tokens with barely trained embeddings)."""
    out = []
    while len(out) < n_tokens:
        run = texts.span_ids(rng, int(rng.integers(run_len[0], run_len[1] + 1))).tolist()
        for _ in range(int(rng.integers(2, 5))):
            out.extend(run)
            gap = int(rng.integers(0, max_gap + 1))
            if gap:
                out.extend(texts.span_ids(rng, gap).tolist())
    return out[:n_tokens]


def far_copy_ids(texts, rng, n_tokens, run_len=(16, 192)):
    """[lead][P][gap][P][tail]: a natural passage P that recurs once at a distance drawn
    uniformly over what the window allows (all distances, short and far), cut to n_tokens."""
    m = int(rng.integers(run_len[0], run_len[1] + 1))
    m = max(1, min(m, n_tokens // 3))
    room = max(0, n_tokens - 2 * m)
    gap = int(rng.integers(0, room + 1))
    lead = int(rng.integers(0, room - gap + 1))
    p = texts.span_ids(rng, m).tolist()
    out = texts.span_ids(rng, lead).tolist() if lead else []
    out += p + (texts.span_ids(rng, gap).tolist() if gap else []) + p
    if len(out) < n_tokens:
        out += texts.span_ids(rng, n_tokens - len(out)).tolist()
    return out[:n_tokens]


def copy_gain(model_fn, rng, vocab_size, n_seqs=4, run=32, seq=128):
    """Mean NLL of a random run's first occurrence minus its repeats' (nats): 0 without
    copying, up to ~ln(vocab) with it. model_fn(ids) -> per-token NLL of ids[1:]."""
    first, again = [], []
    for _ in range(n_seqs):
        r = rng.integers(3, vocab_size, size=run).tolist()
        ids = [1] + (r * (seq // run + 1))[:seq - 1]
        nll = model_fn(ids)
        first.extend(nll[:run - 1])
        again.extend(nll[run - 1:])
    return float(np.mean(first) - np.mean(again))


def passage_copy_gain(model_fn, texts, rng, n_seqs=8, run=40, gap=10):
    """Mean NLL of a natural passage's first occurrence minus its repeat's, `gap` tokens
    later (nats): how much the model copies text it knows the tokens of. The random-id
    copy_gain rises only once copying generalises to rare tokens."""
    first, again = [], []
    for _ in range(n_seqs):
        p = texts.span_ids(rng, run).tolist()
        ids = [1] + p + texts.span_ids(rng, gap).tolist() + p
        nll = model_fn(ids)
        first.extend(nll[1:run])
        again.extend(nll[run + gap + 1:])
    return float(np.mean(first) - np.mean(again))


class Mixer:
    """Training sequences of `seq` tokens (BOS + body): long-range documents packed with
    natural text. Fractions are of documents; lengths favour the whole remaining window."""

    PROFILES = {
        # The long mix: every kind of long-range document, lengths up to the window.
        "long": (("natural", "recurrence", "random_repeat", "passkey_filler", "passkey_natural",
                  "kv"), (0.15, 0.20, 0.20, 0.15, 0.10, 0.20)),
        # The copy curriculum, for short windows: mostly short runs that recur (over alphabets
        # of 10, 100 or all tokens) and short key-value lists, so the copying circuit forms
        # before the long documents need it.
        "copy": (("natural", "random_repeat_short", "kv"), (0.2, 0.5, 0.3)),
        # Induction first: natural passages that recur within a few dozen tokens.
        "induct": (("natural", "passage_repeat", "random_repeat_short"), (0.1, 0.7, 0.2)),
        # The wide mix (models/data-wide): copying at every distance, of any text, beside the
        # retrieval kinds, so the skill is not tied to the training formats.
        "wide": (("natural", "recurrence", "far_copy", "random_repeat_far", "passkey_filler",
                  "passkey_natural", "kv"), (0.2, 0.1, 0.25, 0.15, 0.05, 0.1, 0.15)),
    }

    def __init__(self, sp, texts, rng, seq, bos=1, profile="long"):
        self.sp, self.texts, self.rng, self.seq, self.bos = sp, texts, rng, seq, bos
        self.kinds, self.weights = self.PROFILES[profile]
        self.sep = sp.encode("\n\n")[-1:] or []

    def doc(self, n):
        rng = self.rng
        kind = self.kinds[int(rng.choice(len(self.kinds), p=self.weights))]
        if kind == "natural":
            return self.texts.span_ids(rng, n).tolist()
        if kind == "recurrence":
            return recurrence_ids(self.texts, rng, n)[0]
        if kind == "random_repeat":
            return random_repeat_ids(self.texts, rng, n, self.sp.vocab_size())
        if kind == "far_copy":
            return far_copy_ids(self.texts, rng, n)
        if kind == "random_repeat_far":
            return random_repeat_ids(self.texts, rng, n, self.sp.vocab_size(), run_len=(16, 128),
                                     max_gap=n)
        if kind == "passage_repeat":
            return passage_repeat_ids(self.texts, rng, n)
        if kind == "random_repeat_short":
            return random_repeat_ids(self.texts, rng, n, self.sp.vocab_size(), run_len=(6, 40),
                                     max_gap=24, alphabets=(10, 100, self.sp.vocab_size() - 3))
        if kind.startswith("passkey"):
            d = passkey(self.sp, self.texts, rng, max(64, n - 8), float(rng.random()),
                        haystack=kind.split("_")[1])
        else:
            d = kv_recall(self.sp, rng, max(48, n - 8), n_queries=int(rng.integers(1, 6)))
            if len(self.sp.encode(d["prompt"])) > n:  # a short window: fewer pairs
                d = kv_recall(self.sp, rng, 0, n_queries=1, pairs=max(1, (n - 40) // 11))
        return self.sp.encode(d["prompt"] + d["answer"] + ".")

    def sequence(self):
        body = []
        n = self.seq - 1
        while len(body) < n:
            left = n - len(body)
            lo = min(64, left)
            want = left if self.rng.random() < 0.5 else int(self.rng.integers(lo, max(lo + 1, left)))
            body.extend(self.doc(max(lo, want)))
            body.extend(self.sep)
        return [self.bos] + body[:n]
