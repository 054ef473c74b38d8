#!/usr/bin/env python
"""Build the embedded GPT-2 model end to end: corpus -> BPE tokenizer -> trained model.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 \\
        python data/build_embedded_model.py --minutes 60 --out gpt2_core/data/embedded

Steps (all seeded, see data/README.md for the recipe and the figures of the shipped run):

1. Corpus: Jane Austen's six novels from the Debian package ``r-cran-janeaustenr``
   (texts public domain, package MIT, Julia Silge). Its R lazy-load database
   (``data/Rdata.rdb`` + ``Rdata.rdx``) is read with PyPI ``rdata``, no R needed.
   If the package is not installed, ``apt-get download`` + ``dpkg-deb -x`` fetch it
   into ``--cache`` without root. Hard-wrapped lines are reflowed into paragraphs;
   every chapter is one document; documents are joined with ``<|endoftext|>``.
   Every 20th chapter (index % 20 == 10) is held out for validation.
2. Tokenizer: byte-level BPE (GPT-2's pre-tokenizer regex and byte alphabet) trained
   with HuggingFace ``tokenizers`` on the training split; ``<|endoftext|>`` is added
   last, so its id is ``vocab_size - 1`` exactly like GPT-2's 50256.
3. Model: ``transformers.GPT2LMHeadModel`` (used as a tool; the architecture is GPT-2's:
   learned positions, pre-LN, fused c_attn, Conv1D weights, tanh-GELU, tied head),
   trained with AdamW + warmup + cosine decay on random 256-token windows.
   ``--minutes`` bounds the wall clock: the number of steps is re-estimated from the
   measured speed so the cosine decay ends with the budget (the step count is recorded;
   ``--steps N`` gives a fixed schedule, i.e. a run that is identical on every machine).
4. Save with ``save_pretrained(safe_serialization=True)`` into a temporary directory, with
   ``generation_config.json`` set to sample (``SAMPLING``: the CLI's and HF's pipeline default for this
   model; greedy decoding of a model this small soon loops), write ``training_log.json``, then move it
   to ``--out`` (the package's own data, ``gpt2_core/data/embedded``: it travels in the wheel).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

SYSTEM_JANEAUSTENR = Path("/usr/lib/R/site-library/janeaustenr")
NOVELS = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma",
          "northangerabbey", "persuasion"]  # publication order
EOT = "<|endoftext|>"
SAMPLE_PROMPTS = [
    "It is a truth universally acknowledged, that",
    "Elizabeth could not help",
    "\"My dear Mr. Bennet,\" said his lady to him one day,",
]

LOG_FILE = None


def log(*args):
    msg = " ".join(str(a) for a in args)
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if LOG_FILE is not None:
        with open(LOG_FILE, "a") as f:
            f.write(line + "\n")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- corpus
def find_janeaustenr(cache: Path) -> Path:
    """Return the janeaustenr package directory, fetching the .deb without root if needed."""
    if (SYSTEM_JANEAUSTENR / "data" / "Rdata.rdb").exists():
        return SYSTEM_JANEAUSTENR
    local = cache / "deb" / "usr/lib/R/site-library/janeaustenr"
    if (local / "data" / "Rdata.rdb").exists():
        return local
    cache.mkdir(parents=True, exist_ok=True)
    log("janeaustenr not installed; fetching with apt-get download into", cache)
    subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=cache, check=True)
    deb = sorted(cache.glob("r-cran-janeaustenr_*.deb"))[-1]
    subprocess.run(["dpkg-deb", "-x", str(deb), str(cache / "deb")], check=True)
    return local


def read_novels(pkg: Path) -> dict[str, list[str]]:
    """Read the six character vectors from R's lazy-load database (Rdata.rdx index + Rdata.rdb blobs).

    The .rdx is an ordinary (gzip) .rds file: a list whose ``variables`` maps each name to
    (offset, length) in the .rdb. Each .rdb blob is a 4-byte big-endian uncompressed length
    followed by a zlib stream holding a serialized R object.
    """
    import rdata

    index = rdata.read_rds(pkg / "data" / "Rdata.rdx")
    rdb = (pkg / "data" / "Rdata.rdb").read_bytes()
    novels = {}
    for name, (off, n) in index["variables"].items():
        blob = rdb[int(off):int(off) + int(n)]
        (length,) = struct.unpack(">I", blob[:4])
        raw = zlib.decompress(blob[4:])
        assert len(raw) == length, name
        obj = rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))
        novels[str(name)] = [str(s) for s in obj]
    assert sorted(novels) == sorted(NOVELS), sorted(novels)
    return novels


HEADING = re.compile(r"^(CHAPTER|Chapter) [0-9IVXLC]+\.?$")
VOLUME = re.compile(r"^(VOLUME|Volume) [0-9IVXLC]+\.?$")


def novel_to_chapters(lines: list[str]) -> list[str]:
    """Reflow hard-wrapped lines into paragraphs and cut the novel into chapter documents.

    The first document is the front matter (title, author); a 'VOLUME n' heading stays with
    the chapter that follows it.
    """
    paragraphs, cur = [], []
    for line in lines:
        s = line.strip()
        if s:
            cur.append(s)
        elif cur:
            paragraphs.append(" ".join(cur))
            cur = []
    if cur:
        paragraphs.append(" ".join(cur))
    docs, doc = [], []
    for p in paragraphs:
        is_vol, is_ch = bool(VOLUME.match(p)), bool(HEADING.match(p))
        starts_new = is_vol or (is_ch and not (doc and all(VOLUME.match(q) for q in doc)))
        if starts_new and doc:
            docs.append("\n\n".join(doc))
            doc = []
        doc.append(p)
    if doc:
        docs.append("\n\n".join(doc))
    return docs


def build_corpus(pkg: Path):
    novels = read_novels(pkg)
    train_docs, val_docs, chapter_index = [], [], 0
    for name in NOVELS:
        for i, doc in enumerate(novel_to_chapters(novels[name])):
            if i > 0 and chapter_index % 20 == 10:
                val_docs.append(doc)
            else:
                train_docs.append(doc)
            if i > 0:
                chapter_index += 1
    full_text = ("\n" + EOT + "\n").join(train_docs + val_docs)  # only for the checksum
    return novels, train_docs, val_docs, hashlib.sha256(full_text.encode()).hexdigest()


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(train_docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,          # leave the last id for <|endoftext|>
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer, length=len(train_docs))
    tok.add_special_tokens([EOT])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    assert tok.token_to_id(EOT) == vocab_size - 1
    return tok


def encode_docs(tok, docs: list[str]) -> np.ndarray:
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.uint16)


# ----------------------------------------------------------------------------- training
# generation_config.json's sampling settings: what `python -m gpt2_core generate` (and HF's text-generation
# pipeline) use unless told otherwise. Chosen by reading continuations of a few Austen prompts: readable prose,
# few invented words; greedy decoding (temperature 0) repeats itself within a few dozen tokens.
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.95}


def main(argv=None):
    global LOG_FILE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=Path(__file__).resolve().parent.parent / "gpt2_core" / "data" / "embedded",
                    type=Path)
    ap.add_argument("--minutes", default=60.0, type=float, help="wall-clock budget of the training loop")
    ap.add_argument("--steps", default=None, type=int, help="fixed number of steps (overrides calibration)")
    ap.add_argument("--seed", default=1234, type=int)
    ap.add_argument("--vocab-size", default=4096, type=int)
    ap.add_argument("--n-layer", default=4, type=int)
    ap.add_argument("--n-head", default=4, type=int)
    ap.add_argument("--n-embd", default=192, type=int)
    ap.add_argument("--n-positions", default=256, type=int)
    ap.add_argument("--batch-size", default=16, type=int)
    ap.add_argument("--lr", default=1.5e-3, type=float)
    ap.add_argument("--min-lr", default=1e-4, type=float)
    ap.add_argument("--warmup", default=200, type=int)
    ap.add_argument("--weight-decay", default=0.1, type=float)
    ap.add_argument("--dropout", default=0.1, type=float)
    ap.add_argument("--eval-every", default=12, type=int, help="evaluations per run (plus the final one)")
    ap.add_argument("--threads", default=2, type=int)
    ap.add_argument("--bf16", default=True, action=argparse.BooleanOptionalAction,
                    help="bfloat16 autocast for the training forward/backward (fp32 master weights, "
                         "fp32 evaluation and saving); 1.35x faster on this AVX512-BF16 CPU")
    ap.add_argument("--init-from", default=None, type=Path,
                    help="continue training a model this script saved before (a further stage: its weights, "
                         "a fresh optimiser and schedule; the tokenizer is retrained and must be identical)")
    ap.add_argument("--cache", default=Path.home() / ".cache" / "gpt2_core_data", type=Path)
    args = ap.parse_args(argv)

    t_start = time.time()
    out = args.out.resolve()
    tmp = out.parent / (out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    LOG_FILE = tmp / "train.log"
    if os.environ.get("MALLOC_MMAP_MAX_") != "0":
        log("warning: MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 not set (slower allocation)")
    log("args:", vars(args))

    import torch
    import transformers
    import tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    previous = None
    if args.init_from is not None:
        previous = json.loads((args.init_from / "training_log.json").read_text())
    stage = 1 if previous is None else previous.get("stage", 1) + 1
    # stage 1: the batch order is default_rng(seed); a later stage draws a different order
    rng = np.random.default_rng(args.seed if stage == 1 else [args.seed, stage])

    # 1. corpus
    pkg = find_janeaustenr(args.cache)
    novels, train_docs, val_docs, corpus_sha = build_corpus(pkg)
    rdb_sha, rdx_sha = sha256_file(pkg / "data" / "Rdata.rdb"), sha256_file(pkg / "data" / "Rdata.rdx")
    n_chars = sum(len(d) for d in train_docs + val_docs)
    log(f"corpus: {len(train_docs)} train docs, {len(val_docs)} val docs, {n_chars} chars; "
        f"Rdata.rdb sha256 {rdb_sha}; normalised text sha256 {corpus_sha}")

    # 2. tokenizer
    tok = train_tokenizer(train_docs, args.vocab_size)
    if args.init_from is not None:
        from tokenizers import Tokenizer

        old = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
        assert old.get_vocab() == tok.get_vocab(), "retrained tokenizer differs from --init-from's"
    eot_id = tok.token_to_id(EOT)
    train_ids, val_ids = encode_docs(tok, train_docs), encode_docs(tok, val_docs)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, eot id {eot_id}; train {len(train_ids)} tokens, "
        f"val {len(val_ids)} tokens ({n_chars / (len(train_ids) + len(val_ids)):.2f} chars/token)")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT,
                                     model_max_length=args.n_positions)

    # 3. model
    config = GPT2Config(
        vocab_size=args.vocab_size, n_positions=args.n_positions, n_embd=args.n_embd,
        n_layer=args.n_layer, n_head=args.n_head, activation_function="gelu_new",
        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
        layer_norm_epsilon=1e-5, initializer_range=0.02,
        bos_token_id=eot_id, eos_token_id=eot_id, tie_word_embeddings=True,
    )
    if args.init_from is None:
        model = GPT2LMHeadModel(config)
    else:
        model = GPT2LMHeadModel.from_pretrained(args.init_from, dtype=torch.float32)
        for k in ["vocab_size", "n_positions", "n_embd", "n_layer", "n_head"]:
            assert getattr(model.config, k) == getattr(config, k), k
        log(f"stage {stage}: continuing from {args.init_from} "
            f"({previous['cumulative_tokens_seen'] if 'cumulative_tokens_seen' in previous else previous['tokens_seen']} tokens seen before)")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters (tied head counted once)")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    T, B = args.n_positions, args.batch_size
    train_t = torch.from_numpy(train_ids.astype(np.int64))
    val_t = torch.from_numpy(val_ids.astype(np.int64))

    def get_batch():
        ix = rng.integers(0, len(train_ids) - T - 1, size=B)
        x = torch.stack([train_t[i:i + T] for i in ix])
        y = torch.stack([train_t[i + 1:i + 1 + T] for i in ix])
        return x, y

    @torch.no_grad()
    def evaluate(data_t, n_windows=None, bs=32):
        """Mean next-token loss over non-overlapping windows (all of them if n_windows is None)."""
        model.eval()
        starts = list(range(0, len(data_t) - T - 1, T))
        if n_windows is not None:
            starts = starts[:: max(1, len(starts) // n_windows)][:n_windows]
        total, count = 0.0, 0
        for j in range(0, len(starts), bs):
            s = starts[j:j + bs]
            x = torch.stack([data_t[i:i + T] for i in s])
            y = torch.stack([data_t[i + 1:i + 1 + T] for i in s])
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                                                     reduction="sum")
            total += loss.item()
            count += y.numel()
        model.train()
        return total / count

    def lr_at(step, total):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))

    def save(directory: Path):
        model.generation_config.update(**SAMPLING)
        model.save_pretrained(directory, safe_serialization=True)
        hf_tok.save_pretrained(directory)

    # Horizon: with --steps the schedule is fixed (fully deterministic run). Otherwise the number of
    # steps is re-estimated every 25 steps from the recent speed, so that warmup + cosine decay end
    # when the wall-clock budget does, even on a shared machine whose speed changes during the run.
    budget = args.minutes * 60.0

    def time_left(step, total, elapsed):
        """The training loop's time left: the steps left at the mean speed so far, or (before the step count is
        known) what is left of the budget; the final evaluation adds about 3% of the budget."""
        left = elapsed / step * (total - step) if total is not None else budget - elapsed
        if not fixed:
            left = min(left, max(0.0, budget - elapsed))
        return f"about {left / 60:.0f} min left in the training loop" if left >= 60 else "under a minute left"

    t_loop = time.time()
    fixed = args.steps is not None
    total_steps = args.steps if fixed else None
    history, step, losses, lrs, step_times = [], 0, [], [], []
    eval_interval = budget / args.eval_every
    next_eval_time = eval_interval
    model.train()
    while True:
        if fixed and step >= total_steps:
            break
        t0 = time.time()
        lr = lr_at(step, total_steps if total_steps is not None else 10 ** 9)
        for g in opt.param_groups:
            g["lr"] = lr
        lrs.append(lr)
        x, y = get_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        step_times.append(time.time() - t0)
        elapsed = time.time() - t_loop
        if not fixed and step >= 30 and step % 25 == 0:
            per_step = float(np.mean(step_times[-200:]))
            remaining = budget * 0.97 - elapsed  # keep ~3% for the final evaluation and sampling
            new_total = max(step + 1, step + int(remaining / per_step))
            if total_steps is None:
                log(f"calibration: {per_step * 1000:.0f} ms/step, {B * T / per_step:.0f} tokens/s "
                    f"-> about {new_total} steps in the {args.minutes:g}-minute budget")
            total_steps = new_total
        if step % 50 == 0:
            log(f"step {step}/{total_steps} loss {np.mean(losses[-50:]):.4f} lr {lr:.2e} "
                f"{elapsed / 60:.1f} min, {step * B * T / elapsed:.0f} tok/s, {time_left(step, total_steps, elapsed)}")
        if elapsed >= next_eval_time and (total_steps is None or step < total_steps):
            vl = evaluate(val_t, n_windows=64)
            history.append({"step": step, "tokens": step * B * T, "minutes": elapsed / 60, "lr": lr,
                            "train_loss_recent": float(np.mean(losses[-100:])), "val_loss_subset": vl})
            log(f"eval step {step}: val loss (64 windows) {vl:.4f} ppl {math.exp(vl):.1f}")
            save(tmp)  # checkpoint, so an interrupted run still leaves a model
            next_eval_time += eval_interval
        if total_steps is not None and step >= total_steps:
            break
        if elapsed > budget:
            log(f"wall-clock budget reached at step {step}; stopping")
            break
    train_minutes = (time.time() - t_loop) / 60

    # 4. final figures, samples, save
    model.eval()
    val_loss = evaluate(val_t)
    train_loss = evaluate(train_t, n_windows=len(val_ids) // T)  # same number of windows as val
    log(f"final: train loss {train_loss:.4f} (ppl {math.exp(train_loss):.2f}), "
        f"val loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f})")
    samples = []
    with torch.no_grad():
        for p in SAMPLE_PROMPTS:
            ids = torch.tensor([tok.encode(p).ids])
            gen = model.generate(ids, max_new_tokens=60, do_sample=False, pad_token_id=eot_id,
                                 eos_token_id=eot_id)
            text = tok.decode(gen[0].tolist())
            samples.append({"prompt": p, "text": text})
            log("sample:", repr(text))
    save(tmp)
    tokens_seen = step * B * T
    before = 0 if previous is None else previous.get("cumulative_tokens_seen", previous["tokens_seen"])
    minutes_before = 0.0 if previous is None else previous.get("cumulative_train_minutes", previous["train_minutes"])
    record = {
        "stage": stage,
        "cumulative_tokens_seen": before + tokens_seen,
        "cumulative_train_minutes": minutes_before + train_minutes,
        "seed": args.seed,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "corpus": {
            "source": "Debian r-cran-janeaustenr " + (pkg / "DESCRIPTION").read_text().split("Version:")[1].split()[0],
            "rdata_rdb_sha256": rdb_sha, "rdata_rdx_sha256": rdx_sha,
            "normalised_text_sha256": corpus_sha, "characters": n_chars,
            "train_documents": len(train_docs), "val_documents": len(val_docs),
            "train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)),
        },
        "model": {"parameters": n_params, "n_layer": args.n_layer, "n_head": args.n_head,
                  "n_embd": args.n_embd, "n_positions": args.n_positions, "vocab_size": args.vocab_size},
        "steps": step, "planned_steps": total_steps, "batch_size": B, "tokens_per_step": B * T,
        "tokens_seen": tokens_seen, "epochs": tokens_seen / len(train_ids),
        "train_minutes": train_minutes, "total_minutes": (time.time() - t_start) / 60,
        "final_train_loss": train_loss, "final_train_ppl": math.exp(train_loss),
        "final_val_loss": val_loss, "final_val_ppl": math.exp(val_loss),
        "history": history, "greedy_samples": samples,
        "lr_schedule_every_10_steps": [round(v, 8) for v in lrs[::10]],
        "previous_stage": previous,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "numpy": np.__version__,
                     "python": sys.version.split()[0]},
    }
    (tmp / "training_log.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    LOG_FILE = out / "train.log"
    log(f"done: {out} ({(time.time() - t_start) / 60:.1f} min total)")


if __name__ == "__main__":
    main()
