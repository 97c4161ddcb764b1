"""Train the small BPE tokenizer shipped in recipes/tokenizer/ (tokenizer.json + tokenizer_config.json).

    python scripts/train_tokenizer.py [--corpus tests/fixtures/tiny] [--vocab-size 2048] [--out recipes/tokenizer]

The files are what TorchTitan's HuggingFaceTokenizer reads from ``hf_assets_path`` and what a recipe's
``tokenizer = "tokenizer/tokenizer.json"`` names, so trainer and data agree on ids. Byte-level BPE: every UTF-8
string encodes, nothing maps to an unknown token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


def texts(corpus: Path):
    for shard in sorted(corpus.rglob("*.jsonl")):
        with shard.open(encoding="utf-8") as fh:
            for line in fh:
                yield json.loads(line)["text"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path("tests/fixtures/tiny"))
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path("recipes/tokenizer"))
    args = ap.parse_args()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(args.corpus), trainer=trainer)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    config = {**SPECIAL, "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast"}
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {args.out}/tokenizer.json (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
