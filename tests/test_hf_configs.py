"""Every GPT-2 that HuggingFace transformers can build and save loads here and gives transformers' logits: odd
shapes (a vocabulary below GPT-2's, one head, a width that is no multiple of 64, a short context), in every layout
the loader reads (safetensors in fp32, fp16 and bf16; the legacy pytorch_model.bin). Needs torch and transformers
(the ``reference`` extra); skipped without them, as the other parity tests."""

import warnings

import numpy as np
import pytest

import gpt2_core

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (vocab_size, n_positions, n_embd, n_layer, n_head): GPT2Config() leaves eos/bos at 50256 for every one of them
SHAPES = [(517, 64, 36, 2, 3), (97, 32, 16, 1, 1), (1000, 128, 40, 3, 5)]
LAYOUTS = ["fp32", "fp16", "bf16", "bin"]


def save_hf(tmp_path, shape, layout, seed=0):
    """A GPT-2 built by transformers at ``shape``, saved in ``layout``; -> (directory, transformers' model with the
    saved weights, in float32)."""
    V, P, E, L, H = shape
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=V, n_positions=P, n_embd=E, n_layer=L, n_head=H)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # weights large enough that the logits of different tokens differ clearly
        for p in model.parameters():
            p.normal_(0, 0.2)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(layout, torch.float32)
    directory = tmp_path / f"{layout}-{V}"
    model.to(dtype).save_pretrained(directory)
    if layout == "bin":  # transformers 5 writes safetensors only: the legacy file is torch.save of the state dict
        (directory / "model.safetensors").unlink()
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return directory, model.to(torch.float32)  # the saved weights (rounded to dtype), computed in float32


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "V{}-P{}-E{}-L{}-H{}".format(*s))
def test_a_gpt2_saved_by_transformers_loads_and_gives_its_logits(tmp_path, shape, layout):
    """Both sides compute in float32 from the same (rounded, for fp16/bf16) weights, so they differ only by the
    order of float32 sums: 1e-4 absolute on logits of size ~1-10."""
    directory, reference = save_hf(tmp_path, shape, layout)
    assert (directory / ("pytorch_model.bin" if layout == "bin" else "model.safetensors")).exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = gpt2_core.load_model(directory)
    V, P = shape[0], shape[1]
    assert [str(w.message) for w in caught if "eos_token_id" in str(w.message)] == [
        f"config.json: eos_token_id=50256 is outside the vocabulary (vocab_size={V}): no token can end generation "
        f"early; max_new_tokens decides the length"]
    assert model.config.eos_token_id is None and model.config.vocab_size == V and model.config.n_positions == P
    ids = np.random.default_rng(1).integers(0, V, size=min(P, 20))
    with torch.no_grad():
        expected = reference(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(gpt2_core.forward(model, ids), expected, rtol=1e-4, atol=1e-4)
    # no end-of-text token: generation runs to max_new_tokens, greedy tokens equal to transformers' own
    ours = gpt2_core.kv_cache.generate(model, ids[:4], 6)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor(ids[:4])[None], max_new_tokens=6, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    assert len(ours) == 6 and ours == theirs


def test_an_end_of_text_id_inside_the_vocabulary_is_kept(tmp_path):
    V = 517
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=24, n_layer=1, n_head=2,
                                     eos_token_id=V - 1, bos_token_id=V - 1)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a sound config
        assert gpt2_core.load_model(tmp_path).config.eos_token_id == V - 1


@pytest.mark.parametrize("activation", ["gelu_fast", "gelu_accurate", "gelu_python_tanh"])
def test_every_name_transformers_gives_the_tanh_gelu_loads(tmp_path, activation):
    """transformers computes GPT-2's tanh GELU under several names: each loads and gives transformers' logits."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=24, n_layer=2, n_head=2,
                                     activation_function=activation, eos_token_id=96)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    ids = np.arange(1, 12)
    with torch.no_grad():
        expected = model(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(gpt2_core.forward(gpt2_core.load_model(tmp_path), ids), expected, rtol=1e-4, atol=1e-4)


def test_the_first_end_of_text_id_inside_the_vocabulary_is_kept(tmp_path):
    """HF allows a list of end-of-sequence ids; one outside a small vocabulary is skipped, not the whole list."""
    config = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=24, n_layer=1, n_head=2,
                                     eos_token_id=[50256, 5])
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gpt2_core.load_model(tmp_path).config.eos_token_id == 5
