#!/usr/bin/python3
"""Trains the SentencePiece BPE tokenizer of Subspace-tiny (Llama-style: unk=0, bos=1, eos=2,
byte fallback, dummy prefix, no normalisation so that a plain llama.cpp-style SPM tokenizer
reproduces it exactly)."""
import argparse
import os

import sentencepiece as spm


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--train", default="models/data/train.txt")
    ap.add_argument("--prefix", default="models/work/tokenizer")
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.prefix), exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=args.train,
        model_prefix=args.prefix,
        model_type="bpe",
        vocab_size=args.vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentence_length=16384,
        num_threads=2,
        minloglevel=1,
    )
    print("wrote %s.model" % args.prefix, flush=True)


if __name__ == "__main__":
    main()
