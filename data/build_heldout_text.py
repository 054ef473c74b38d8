"""Write the embedded model's held-out text: the 13 validation chapters training never saw.

``build_embedded_model.py`` holds out every chapter whose number (counted across the six novels in publication
order) is 10 modulo 20, and trains its tokenizer and model on the rest only. This script rebuilds the same corpus
with the same functions and writes those 13 chapters, normalised exactly as training saw them, to
``gpt2_core/data/heldout/austen_validation.txt``, documents joined by ``"\\n<|endoftext|>\\n"`` (the separator of
the corpus checksum in data/README.md; no chapter contains it). Chapter 6 measures the perplexity of quantized
models on it (``gpt2_core.ch06_quantization.quantization.heldout_token_ids``).

    python data/build_heldout_text.py          # needs rdata (the `reference` extra) and the janeaustenr .deb
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import build_embedded_model as corpus

OUT = Path(__file__).resolve().parent.parent / "gpt2_core" / "data" / "heldout" / "austen_validation.txt"
SEPARATOR = "\n" + corpus.EOT + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, type=Path)
    ap.add_argument("--cache", default=Path.home() / ".cache" / "gpt2_core_data", type=Path)
    args = ap.parse_args(argv)
    _, train_docs, val_docs, corpus_sha = corpus.build_corpus(corpus.find_janeaustenr(args.cache))
    assert corpus_sha == "dfbda76abaf41606872dadca15a6478550026578a86d2966775c720b27e66bb1", corpus_sha
    assert len(val_docs) == 13 and not any(corpus.EOT in d for d in val_docs)
    assert not set(val_docs) & set(train_docs)
    text = SEPARATOR.join(val_docs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: {len(val_docs)} chapters, {len(text):,} characters, "
          f"sha256 {hashlib.sha256(text.encode()).hexdigest()}")


if __name__ == "__main__":
    main()
