"""Regenerate the built-in tokenizer (t1model/assets/tokenizer.json) from the text in t1model/assets/corpus/.

    python scripts/train_tokenizer.py                  # retrain tokenizer.json from the committed corpus
    python scripts/train_tokenizer.py --write-corpus   # first regenerate the synthetic corpus files (seeded)
    python scripts/train_tokenizer.py --check          # retrain in memory; exit 1 if it differs from the file

Byte-level BPE with the Qwen3 chat special tokens at ids 0..8 and 4096 ids in total. Training is single-threaded
(RAYON_NUM_THREADS=1, set before importing tokenizers) so the merges do not depend on thread scheduling.
The corpus is synthetic shell work written by `write_corpus`: terminal sessions, listings, git and pytest output,
tracebacks, CSV/JSON, configuration files, task instructions and ChatML agent episodes with Qwen3 tool calls.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from corpus_gen import write_corpus  # noqa: E402

ASSETS = ROOT / "t1model" / "assets"
CORPUS_DIR = ASSETS / "corpus"
TOKENIZER_PATH = ASSETS / "tokenizer.json"
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                  "</tool_response>", "<think>", "</think>"]
# Letters-words with an optional leading non-letter, single digits, punctuation runs, newline runs, spaces:
# the same split classes Qwen's tokenizers use, so numbers in command output tokenize digit by digit.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus_files(corpus_dir: Path = CORPUS_DIR) -> list[Path]:
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt corpus files in {corpus_dir}")
    return files


def train(corpus_dir: Path = CORPUS_DIR) -> Tokenizer:
    """Train the byte-level BPE on every *.txt file of `corpus_dir` (sorted order)."""
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in corpus_files(corpus_dir)], trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {tok.get_vocab_size()} ids, expected {VOCAB_SIZE}: corpus too small")
    return tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-corpus", action="store_true", help="regenerate the synthetic corpus files first")
    ap.add_argument("--check", action="store_true", help="compare with the committed tokenizer.json, write nothing")
    args = ap.parse_args()
    if args.write_corpus:
        sizes = write_corpus(CORPUS_DIR)
        print(f"corpus: {len(sizes)} files, {sum(sizes.values()) / 1e3:.0f} kB in {CORPUS_DIR}")
    text = train().to_str(pretty=True) + "\n"
    if args.check:
        same = TOKENIZER_PATH.exists() and TOKENIZER_PATH.read_text() == text
        print(f"{TOKENIZER_PATH}: {'up to date' if same else 'DIFFERS from a fresh training run'}")
        return 0 if same else 1
    TOKENIZER_PATH.write_text(text)
    print(f"wrote {TOKENIZER_PATH} ({VOCAB_SIZE} ids)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
