#!/usr/bin/env python
"""Write the reference outputs that the NumPy model is tested against: ``data/reference/`` for the random
models, ``gpt2_core/data/reference/`` for the embedded model (chapter 1 checks its forward pass against it, so it
travels in the package).

    python data/make_reference.py            # random models + embedded model
    python data/make_reference.py --only random
    python data/make_reference.py --only embedded

Reference implementation: HuggingFace ``transformers.GPT2LMHeadModel`` (torch, CPU), float32,
``model.eval()``, ``attn_implementation="eager"``. Every model is first written to disk and the
reference is computed from the files as loaded back, so the files and the outputs agree.

Each ``.npz`` holds, for prompts i = 0 .. num_prompts-1:
    input_ids_i  int64   [T_i]          the prompt
    logits_i     float32 [T_i, vocab]   logits at every position (one forward of the whole prompt)
and
    greedy_input_ids int64 [T_g]        a prompt
    greedy_ids       int64 [32]         32 new tokens: at each step a full forward of prompt + tokens
                                        so far, argmax of the last position; no stop at end-of-text
    num_prompts      int64 []

Random models (weights from ``torch.manual_seed``; ``initializer_range=0.2`` instead of 0.02 and
every bias / LayerNorm parameter perturbed, so that logits are spread out, argmax ties are
unlikely, and an implementation that drops a bias or a LayerNorm gain fails the test):
    random_h3_e96/  2 layers, 3 heads, n_embd 96, vocab 1001, n_positions 64, fp32 model.safetensors
    random_l1_bin/  1 layer, 2 heads, n_embd 64, vocab 515, n_positions 32, legacy pytorch_model.bin
                    in the original hub layout (no ``transformer.`` prefix, ``h.N.attn.bias`` causal
                    mask [1, 1, n_positions, n_positions] float32 and ``h.N.attn.masked_bias`` = -1e4
                    buffers, no ``lm_head.weight``), written with ``torch.save`` (zip format)
    random_fp16/    2 layers, 4 heads, n_embd 128, vocab 777, n_positions 48, float16 model.safetensors;
                    reference computed in float32 on the fp16 weights upcast to float32
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parent
REF = DATA / "reference"
PACKAGE_DATA = DATA.parent / "gpt2_core" / "data"  # the files the package reads at run time
EMBEDDED_REF = PACKAGE_DATA / "reference"
N_NEW = 32

EMBEDDED_PROMPTS = [
    "Mr. Darcy was not",
    "It is a truth universally acknowledged, that a single man",
    "\"I do not know,\" said Elizabeth, \"what you can mean by it; but I am sure",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, "
    "seemed to unite some of the best blessings of existence;",
]
EMBEDDED_GREEDY_PROMPT = "Mrs. Bennet was"

RANDOM_MODELS = {
    "random_h3_e96": dict(config=dict(n_layer=2, n_head=3, n_embd=96, vocab_size=1001, n_positions=64),
                          seed=101, fmt="safetensors", lengths=[5, 23, 64], greedy_len=8),
    "random_l1_bin": dict(config=dict(n_layer=1, n_head=2, n_embd=64, vocab_size=515, n_positions=32),
                          seed=202, fmt="bin", lengths=[3, 32], greedy_len=1),  # 1 + 31 = 32 positions
    "random_fp16": dict(config=dict(n_layer=2, n_head=4, n_embd=128, vocab_size=777, n_positions=48),
                        seed=303, fmt="fp16", lengths=[6, 19, 48], greedy_len=10),
}


def load_eval(directory: Path):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model


@torch.no_grad()
def reference(model, prompts: list[np.ndarray], greedy_prompt: np.ndarray) -> dict:
    out = {"num_prompts": np.int64(len(prompts))}
    n_pos = model.config.n_positions
    for i, ids in enumerate(prompts):
        ids = np.asarray(ids, dtype=np.int64)
        assert 1 <= len(ids) <= n_pos
        logits = model(input_ids=torch.from_numpy(ids)[None]).logits[0]
        out[f"input_ids_{i}"] = ids
        out[f"logits_{i}"] = logits.numpy().astype(np.float32)
    seq = [int(t) for t in greedy_prompt]
    assert len(seq) + N_NEW - 1 <= n_pos
    new = []
    for _ in range(N_NEW):  # manual greedy loop: full forward each step, no KV cache, no eos stop
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        assert top2[0] - top2[1] > 1e-4, "argmax (near) tie: choose another seed or prompt"
        t = int(torch.argmax(logits))
        new.append(t)
        seq.append(t)
    out["greedy_input_ids"] = np.asarray(greedy_prompt, dtype=np.int64)
    out["greedy_ids"] = np.asarray(new, dtype=np.int64)
    return out


def make_random_model(name: str, spec: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    c = spec["config"]
    config = GPT2Config(**c, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                        initializer_range=0.2, bos_token_id=c["vocab_size"] - 1,
                        eos_token_id=c["vocab_size"] - 1, tie_word_embeddings=True)
    torch.manual_seed(spec["seed"])
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # HF init leaves biases 0 and LayerNorm gains 1: perturb them
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif ".ln_" in n and n.endswith(".weight"):
                p.normal_(1.0, 0.1)
    model.eval()
    d = REF / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    if spec["fmt"] == "safetensors":
        model.save_pretrained(d, safe_serialization=True)
    elif spec["fmt"] == "fp16":
        model.half().save_pretrained(d, safe_serialization=True)
    elif spec["fmt"] == "bin":
        config.save_pretrained(d)
        sd = original_hub_state_dict(model)
        torch.save(sd, d / "pytorch_model.bin")  # default zip format
        back = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        assert list(back) == list(sd) and all(torch.equal(back[k], sd[k]) for k in sd), "round trip"
    # the reference comes from the files as loaded back (fp16 upcast to fp32 by from_pretrained)
    loaded = load_eval(d)
    if spec["fmt"] == "fp16":
        import safetensors.torch

        stored = safetensors.torch.load_file(d / "model.safetensors")
        assert all(v.dtype == torch.float16 for v in stored.values())
        assert torch.equal(loaded.transformer.h[0].attn.c_attn.weight,
                           stored["transformer.h.0.attn.c_attn.weight"].float())
    else:
        for (n, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(p, q), n
    rng = np.random.default_rng(spec["seed"])
    prompts = [rng.integers(0, c["vocab_size"], size=n) for n in spec["lengths"]]
    greedy = rng.integers(0, c["vocab_size"], size=spec["greedy_len"])
    ref = reference(loaded, prompts, greedy)
    np.savez_compressed(d / "reference.npz", **ref)
    print(f"{name}: {spec['fmt']}, {sum(p.numel() for p in model.parameters())} params, "
          f"prompt lengths {spec['lengths']}, greedy {ref['greedy_ids'][:8].tolist()}...")


def original_hub_state_dict(model) -> dict:
    """State dict as in the original hub ``gpt2/pytorch_model.bin``: GPT2Model keys (no
    ``transformer.`` prefix), the causal-mask buffers each block used to register, no lm_head."""
    n = model.config.n_positions
    sd = {}
    for k, v in model.transformer.state_dict().items():
        sd[k] = v.detach().clone().contiguous()
        if k.endswith(".ln_1.bias"):  # the original order: ln_1, attn.bias, attn.masked_bias, c_attn ...
            prefix = k[: -len("ln_1.bias")]
            sd[prefix + "attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.float32)).view(1, 1, n, n)
            sd[prefix + "attn.masked_bias"] = torch.tensor(-1e4)
    assert not any(k.startswith("transformer.") or k.startswith("lm_head") for k in sd)
    return sd


def make_embedded():
    from tokenizers import Tokenizer

    d = PACKAGE_DATA / "embedded"
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    model = load_eval(d)
    prompts = [np.asarray(tok.encode(p).ids, dtype=np.int64) for p in EMBEDDED_PROMPTS]
    lengths = [len(p) for p in prompts]
    assert all(5 <= n <= 40 for n in lengths), lengths
    greedy = np.asarray(tok.encode(EMBEDDED_GREEDY_PROMPT).ids, dtype=np.int64)
    ref = reference(model, prompts, greedy)
    EMBEDDED_REF.mkdir(exist_ok=True)
    np.savez_compressed(EMBEDDED_REF / "embedded.npz", **ref)
    text = tok.decode(greedy.tolist() + ref["greedy_ids"].tolist())
    print(f"embedded: prompt lengths {lengths}; greedy: {text!r}")
    (EMBEDDED_REF / "embedded_prompts.json").write_text(json.dumps(
        {"prompts": EMBEDDED_PROMPTS, "greedy_prompt": EMBEDDED_GREEDY_PROMPT, "greedy_text": text},
        indent=2) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["random", "embedded"], default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    REF.mkdir(exist_ok=True)
    if args.only in (None, "random"):
        for name, spec in RANDOM_MODELS.items():
            make_random_model(name, spec)
    if args.only in (None, "embedded"):
        make_embedded()


if __name__ == "__main__":
    main()
