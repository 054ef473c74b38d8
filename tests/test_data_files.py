"""The committed data files (gpt2_core/data and data/): tokenizers, checkpoints, reference outputs. No torch needed.

    python -m pytest tests/test_data_files.py
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

DATA = Path(__file__).parent.parent / "data"
PACKAGE_DATA = Path(__file__).parent.parent / "gpt2_core" / "data"
EMBEDDED = PACKAGE_DATA / "embedded"
GPT2_TOKENIZER = PACKAGE_DATA / "gpt2_tokenizer" / "tokenizer.json"
REFERENCE = DATA / "reference"
EOT = "<|endoftext|>"

MODEL_DIRS = [EMBEDDED, REFERENCE / "random_h3_e96", REFERENCE / "random_l1_bin", REFERENCE / "random_fp16"]
SAFETENSORS_DIRS = [EMBEDDED, REFERENCE / "random_h3_e96", REFERENCE / "random_fp16"]
REFERENCE_FILES = [(PACKAGE_DATA / "reference" / "embedded.npz", EMBEDDED)] + [
    (d / "reference.npz", d) for d in MODEL_DIRS[1:]]

ROUND_TRIP = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "\"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard that Netherfield Park is let at last?\"",
    "  two leading spaces, tabs\t\tand\nnew\n\nlines  ",
    "naïve café, 日本語, emoji 😀👍, £5 & 10s.",
]


def config_of(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def ids(d: Path) -> str:
    return d.name


# ----------------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def gpt2_tok():
    return Tokenizer.from_file(str(GPT2_TOKENIZER))


@pytest.fixture(scope="module")
def embedded_tok():
    return Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))


def test_gpt2_tokenizer_hard_facts(gpt2_tok):
    assert gpt2_tok.get_vocab_size() == 50257
    assert gpt2_tok.token_to_id(EOT) == 50256
    assert gpt2_tok.encode("Hello world").ids == [15496, 995]
    assert gpt2_tok.encode("Hello, world!").ids == [15496, 11, 995, 0]
    assert gpt2_tok.encode(EOT).ids == [50256]
    assert gpt2_tok.encode("a" + EOT + "b").ids == [64, 50256, 65]
    assert gpt2_tok.encode(" the").ids == [262]
    assert gpt2_tok.encode("\n").ids == [198]
    assert gpt2_tok.decode([15496, 995]) == "Hello world"


def test_gpt2_tokenizer_layout():
    j = json.loads(GPT2_TOKENIZER.read_text())
    assert j["model"]["type"] == "BPE"
    assert len(j["model"]["merges"]) == 50000  # all merges, including the last one
    assert j["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                  "use_regex": True}
    assert j["decoder"]["type"] == "ByteLevel"
    assert [t["content"] for t in j["added_tokens"] if t["special"]] == [EOT]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizers_round_trip(gpt2_tok, embedded_tok, text):
    for tok in (gpt2_tok, embedded_tok):
        enc = tok.encode(text).ids
        assert tok.decode(enc) == text


def test_embedded_tokenizer_matches_config(embedded_tok):
    cfg = config_of(EMBEDDED)
    eot = embedded_tok.token_to_id(EOT)
    assert embedded_tok.get_vocab_size() == cfg["vocab_size"]
    assert eot == cfg["eos_token_id"] == cfg["bos_token_id"] == cfg["vocab_size"] - 1
    assert embedded_tok.encode(EOT).ids == [eot]
    assert embedded_tok.encode("Hello" + EOT + "world").ids.count(eot) == 1
    j = json.loads((EMBEDDED / "tokenizer.json").read_text())
    assert j["pre_tokenizer"]["type"] == "ByteLevel" and j["pre_tokenizer"]["add_prefix_space"] is False
    assert j["decoder"]["type"] == "ByteLevel"
    assert [t["content"] for t in j["added_tokens"] if t["special"]] == [EOT]
    # a real English-text BPE: common words are single tokens
    for word in [" the", " and", " Elizabeth", " Mr"]:
        assert len(embedded_tok.encode(word).ids) == 1, word


# ----------------------------------------------------------------------------- checkpoints
def expected_shapes(cfg: dict) -> dict[str, tuple]:
    E, V, P = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
    inner = cfg.get("n_inner") or 4 * E
    shapes = {"wte.weight": (V, E), "wpe.weight": (P, E), "ln_f.weight": (E,), "ln_f.bias": (E,)}
    for i in range(cfg["n_layer"]):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.weight": (E,), h + "ln_1.bias": (E,),
            h + "attn.c_attn.weight": (E, 3 * E), h + "attn.c_attn.bias": (3 * E,),   # Conv1D: [in, out]
            h + "attn.c_proj.weight": (E, E), h + "attn.c_proj.bias": (E,),
            h + "ln_2.weight": (E,), h + "ln_2.bias": (E,),
            h + "mlp.c_fc.weight": (E, inner), h + "mlp.c_fc.bias": (inner,),
            h + "mlp.c_proj.weight": (inner, E), h + "mlp.c_proj.bias": (E,),
        })
    return shapes


@pytest.mark.parametrize("d", MODEL_DIRS, ids=ids)
def test_config(d):
    cfg = config_of(d)
    assert cfg["model_type"] == "gpt2"
    assert cfg["activation_function"] == "gelu_new"
    assert cfg["layer_norm_epsilon"] == 1e-5
    assert cfg["n_embd"] % cfg["n_head"] == 0
    assert cfg["eos_token_id"] == cfg["vocab_size"] - 1
    assert cfg.get("tie_word_embeddings", True) is True


@pytest.mark.parametrize("d", SAFETENSORS_DIRS, ids=ids)
def test_safetensors_shapes(d):
    cfg = config_of(d)
    tensors = load_file(d / "model.safetensors")
    want = {"transformer." + k: v for k, v in expected_shapes(cfg).items()}
    assert set(tensors) == set(want), set(tensors) ^ set(want)  # tied head: no lm_head.weight stored
    dtype = np.float16 if d.name == "random_fp16" else np.float32
    for k, shape in want.items():
        assert tensors[k].shape == shape, k
        assert tensors[k].dtype == dtype, k
        assert np.isfinite(tensors[k]).all(), k


def test_embedded_model_size_and_log():
    cfg = config_of(EMBEDDED)
    assert cfg["n_positions"] >= 256
    n_params = sum(int(np.prod(s)) for s in expected_shapes(cfg).values())
    assert (EMBEDDED / "model.safetensors").stat().st_size < 4 * n_params + 100_000  # fp32, tied head
    log = json.loads((EMBEDDED / "training_log.json").read_text())
    for key in ["tokens_seen", "final_train_loss", "final_val_loss", "final_val_ppl", "train_minutes", "seed"]:
        assert key in log
    assert log["model"]["parameters"] == n_params
    assert log["final_val_loss"] < 4.5  # far below uniform (ln 4096 = 8.3)


def test_legacy_bin_is_torch_zip():
    d = REFERENCE / "random_l1_bin"
    assert not (d / "model.safetensors").exists()
    with zipfile.ZipFile(d / "pytorch_model.bin") as z:  # torch.save's default zip format
        names = z.namelist()
        assert any(n.endswith("/data.pkl") for n in names)
        pickle = z.read(next(n for n in names if n.endswith("/data.pkl")))
    cfg = config_of(d)
    for k in expected_shapes(cfg):
        assert k.encode() in pickle, k  # original hub layout: no "transformer." prefix
    assert b"h.0.attn.bias" in pickle and b"transformer." not in pickle and b"lm_head" not in pickle


# ----------------------------------------------------------------------------- reference outputs
@pytest.mark.parametrize("path,d", REFERENCE_FILES, ids=[p.parent.name + "/" + p.name for p, _ in REFERENCE_FILES])
def test_reference_npz(path, d):
    cfg = config_of(d)
    V, P = cfg["vocab_size"], cfg["n_positions"]
    with np.load(path) as z:
        n = int(z["num_prompts"])
        expected = {"num_prompts", "greedy_input_ids", "greedy_ids"}
        expected |= {f"{k}_{i}" for i in range(n) for k in ("input_ids", "logits")}
        assert set(z.files) == expected
        lengths = []
        for i in range(n):
            x, logits = z[f"input_ids_{i}"], z[f"logits_{i}"]
            assert x.dtype == np.int64 and x.ndim == 1 and 1 <= len(x) <= P
            assert ((0 <= x) & (x < V)).all()
            assert logits.dtype == np.float32 and logits.shape == (len(x), V)
            assert np.isfinite(logits).all() and logits.std() > 0.1
            lengths.append(len(x))
        g, new = z["greedy_input_ids"], z["greedy_ids"]
        assert g.dtype == np.int64 and new.dtype == np.int64 and new.shape == (32,)
        assert len(g) + 32 - 1 <= P and ((0 <= new) & (new < V)).all()
    if d == EMBEDDED:
        assert 3 <= n <= 4 and all(5 <= t <= 40 for t in lengths) and len(set(lengths)) == n
    else:
        assert 2 <= n <= 3 and P in lengths


def test_the_held_out_text_is_the_validation_split():
    """gpt2_core/data/heldout/austen_validation.txt (data/build_heldout_text.py): the 13 chapters training held out,
    as the checksum pins them; tokenized each followed by <|endoftext|>, they are the 44,531 validation tokens that
    data/README.md and the training log count."""
    import hashlib

    path = PACKAGE_DATA / "heldout" / "austen_validation.txt"
    text = path.read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode()).hexdigest() == \
        "d60e861f05e65ab4a2b78a86d4e1281323ff4849f52911fea07184044e182941"
    docs = text.split("\n" + EOT + "\n")
    assert len(docs) == 13 and all(d.split("\n", 1)[0].lower().startswith("chapter ") for d in docs)
    tok = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))
    assert sum(len(tok.encode(d).ids) + 1 for d in docs) == 44_531
