#!/usr/bin/env python3
"""The pre-tokenizers' splits against python3-regex running the published split patterns.

For every pre-tokenizer name, random texts (seeded) built from the characters that make the
patterns differ -- contractions in both cases, the case-folding oddities (U+017F, U+212A,
U+0130), every kind of white space, digits of several scripts, CJK, Hangul, marks, emoji,
letters new in Unicode 15 -- are split by our matcher (pretokenize_helper) and by the `regex`
module applying the same patterns in sequence as HF tokenizers' Split(behavior="isolated")
does. Also checks that patterns outside the supported subset are refused, not mis-matched.

usage: pretokenizer_oracle_test.py PATH/TO/pretokenize_helper
"""
import random
import subprocess
import sys

import regex

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
          r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Non-ASCII written as escapes (python3-regex reads \uXXXX), so no editor can normalise them.
DEEPSEEK_LLM_LETTERS = (
    r"\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    r"\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    r"\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-"
    r"\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    r"\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    r"\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    r"\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    r"\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-"
    r"\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-"
    r"\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    r"\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    r"\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    r"\U0001e900-\U0001e943]+")
DEEPSEEK_LLM_PUNCT = r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
CJK_HANGUL = r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
CJK_KANA = r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
FINNISH = r" ?[^(\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

# Published patterns (tokenizer.json of each family), by the name llama.cpp writes into
# tokenizer.ggml.pre.
SPECS = [
    (["default"], [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]),
    (["llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "chatglm-bpe"], [LLAMA3]),
    (["deepseek-llm"], [r"[\r\n]", DEEPSEEK_LLM_LETTERS, DEEPSEEK_LLM_PUNCT, r"\s+$",
                        CJK_HANGUL, r"\p{N}+"]),
    (["deepseek-coder"], [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_HANGUL, r"\p{N}"]),
    (["deepseek-v3"], [r"\p{N}{1,3}", CJK_KANA,
                       r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?"
                       r"[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]),
    (["falcon"], [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"]),
    (["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"],
     [r"\p{N}", GPT2]),
    (["gpt-2", "phi-2", "roberta-bpe", "jina-es", "jina-de", "gigachat", "jina-v1-en",
      "jina-v2-es", "jina-v2-de", "jina-v2-code", "mpt", "olmo", "jais"], [GPT2]),
    (["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"], [QWEN2]),
    (["poro-chat", "bloom", "gpt3-finnish"], [FINNISH]),
    (["viking"], [FINNISH, r"\p{N}"]),
    (["tekken"], [TEKKEN]),
]

POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") * 3 + list("0123456789") * 2 +
    list(" " * 20) + list("\n" * 6) + list("\r\t\x0b\x0c\x1c\x85\xa0\u1680\u2028\u3000\u200b") +
    list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") * 2 +
    list("\u017f\u212a\u0130\u0131ßéÉñÑçøæ") +  # case folding, Latin-1 letters
    list("ΑαΩωДдЖж\u1fbe\u0386\u03b9ǅ") + list("٣٤۵०१") + list("Ⅻ½²") +  # Greek, Cyrillic, other digits, No/Nl
    list("我想在工作一龥가힣あアー") + list("\u0301\u0308\u093f") +  # CJK, Hangul, kana, marks
    list("…。，、।۔،‘’“”！／：～") + ["\U0001F600", "\U0001F680", "\u200d", "\ufe0f"] +
    ["\U0001E030", "\u0870", "\U00011F00"]  # Unicode 15 / 14 letters
)
CHUNKS = ["'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'LL", "'d", "'\u017f", " 's", "\r\n",
          "  \n", " \n\n ", "333333", "1234567", "Hello", " world", "IMGIMG", "\t\t"]


def split_published(patterns, text):
    pieces = [text] if text else []
    for pattern in patterns:
        compiled = regex.compile(pattern)
        new = []
        for s in pieces:
            pos = 0
            for m in compiled.finditer(s):
                if m.start() == m.end():
                    continue
                if m.start() > pos:
                    new.append(s[pos:m.start()])
                new.append(m.group())
                pos = m.end()
            if pos < len(s):
                new.append(s[pos:])
        pieces = new
    return [len(p) for p in pieces]


def random_text(rng):
    parts = []
    for _ in range(rng.randint(0, 14)):
        if rng.random() < 0.25:
            parts.append(rng.choice(CHUNKS))
        else:
            parts.append("".join(rng.choice(POOL) for _ in range(rng.randint(1, 6))))
    return "".join(parts)


def run_helper(helper, mode, arg, texts):
    stdin = "".join(t.encode("utf-8").hex() + "\n" for t in texts)
    out = subprocess.run([helper, mode, arg], input=stdin, capture_output=True, text=True,
                         check=True, timeout=240).stdout
    return out.splitlines()


def main():
    helper = sys.argv[1]
    rng = random.Random(20261126)
    texts = [random_text(rng) for _ in range(1500)]
    texts += ["", " ", "\n", "   Hello", "Hello  world", "a  \n  b", "x\u3000\u3000y", "   \n",
              "'S'll", "3333333", "\u212a'\u017f", "   5", "\u00a0\u00a0x", "A\n", "a \n"]
    known = set(run_helper(helper, "--names", "", []) if False else
                subprocess.run([helper, "--names"], capture_output=True, text=True,
                               check=True).stdout.split())
    failures = 0
    tested = set()
    for names, patterns in SPECS:
        expected = [" ".join(map(str, split_published(patterns, t))) for t in texts]
        for name in names:
            tested.add(name)
            got = run_helper(helper, "--pre", name, texts)
            for text, want, have in zip(texts, expected, got):
                if want != have:
                    failures += 1
                    if failures <= 10:
                        print("%s: %r\n  python3-regex %s\n  ours          %s" %
                              (name, text, want, have))
            if len(got) != len(texts):
                failures += 1
                print("%s: helper printed %d lines for %d texts" % (name, len(got), len(texts)))
    if known != tested:
        print("names differ: ours only %s, test only %s" %
              (sorted(known - tested), sorted(tested - known)))
        failures += 1

    # Constructs outside the subset are refused, never matched approximately.
    for pattern in [r"(?<=a)b", r"(a)\1", r"a+?", r"a++", r"\w+", r"\bfoo", r"(?:ab)+",
                    r"(?i:é)", r"(?i:\p{Lu})", r"a*", r"(?P<n>a)", r"[[:alpha:]]", r"(a|)+"]:
        out = run_helper(helper, "--pattern", pattern.encode("utf-8").hex(), ["a"])
        if not out or not out[0].startswith("ERROR"):
            failures += 1
            print("pattern %r was accepted: %s" % (pattern, out))
    # ... and what is accepted matches as python3-regex does, one pattern at a time too.
    for pattern in [r"(?:ab){1,3}c?", r"[^a-c\d]+x|y{2,}", r"(?=\p{Lu})\p{L}{2}", r"\s+$",
                    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"[\p{P}!-/:-@\[-`{-~]", r"^\s*\S",
                    r"\x41\u00e9+", r".+"]:
        sample = texts[:300] + ["ababC", "abababx", "IMGIMGABZ", "yyy\n", "Aé\n", "AB\n"]
        want = [" ".join(map(str, split_published([pattern], t))) for t in sample]
        got = run_helper(helper, "--pattern", pattern.encode("utf-8").hex(), sample)
        for text, w, h in zip(sample, want, got):
            if w != h:
                failures += 1
                if failures <= 20:
                    print("pattern %r on %r: python3-regex %s, ours %s" % (pattern, text, w, h))
    print("%d pre-tokenizer names x %d texts checked; %d failures" %
          (len(tested), len(texts), failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
