"""Chapter 1's layer functions and the whole forward pass, against definitions and against HF transformers."""

import numpy as np
import pytest
from helpers import PACKAGE_DATA, TINY, prompts, reference_dirs, tiny_model

import gpt2_core
from gpt2_core.ch01_forward import model as M

rng = np.random.default_rng(0)


def test_gelu_is_the_tanh_approximation_and_stays_float32():
    x = np.linspace(-6, 6, 101, dtype=np.float32)
    expected = 0.5 * x.astype(np.float64) * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x.astype(np.float64) ** 3)))
    assert M.gelu(x).dtype == np.float32
    np.testing.assert_allclose(M.gelu(x), expected, atol=1e-6)
    assert M.gelu(np.float32(0)) == 0 and abs(M.gelu(np.float32(3)) - 2.996363) < 1e-5


def test_softmax_is_stable_for_huge_logits():
    x = np.array([[1000.0, 1001.0, 1002.0], [-1e30, 0.0, -np.inf]], dtype=np.float32)
    p = M.softmax(x)
    assert np.isfinite(p).all() and p.dtype == np.float32
    np.testing.assert_allclose(p.sum(-1), 1, rtol=1e-6)
    np.testing.assert_allclose(p[0], np.exp([-2, -1, 0]) / np.exp([-2, -1, 0]).sum(), rtol=1e-6)
    np.testing.assert_array_equal(p[1], [0, 1, 0])


def test_layer_norm_normalises_then_scales():
    x = rng.standard_normal((5, 8), dtype=np.float32) * 3 + 7
    y = M.layer_norm(x, np.ones(8, np.float32), np.zeros(8, np.float32), eps=1e-5)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-5)
    np.testing.assert_allclose(y.std(-1), 1, atol=1e-3)
    w, b = np.arange(8, dtype=np.float32), np.full(8, 2, np.float32)
    np.testing.assert_allclose(M.layer_norm(x, w, b, 1e-5), y * w + b, atol=1e-5)


def test_split_and_merge_heads_are_inverse():
    x = rng.standard_normal((7, 12), dtype=np.float32)
    h = M.split_heads(x, 3)
    assert h.shape == (3, 7, 4)
    np.testing.assert_array_equal(h[1], x[:, 4:8])  # head 1 owns columns 4..7
    np.testing.assert_array_equal(M.merge_heads(h), x)


def attention_by_loops(q, k, v):
    """The definition, one head, one query at a time, no mask trick: query i sees keys 0..(S - T + i)."""
    H, T, D = q.shape
    S = k.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(H):
        for i in range(T):
            visible = S - T + i + 1
            s = k[h, :visible].astype(np.float64) @ q[h, i] / np.sqrt(D)
            w = np.exp(s - s.max())
            out[h, i] = (w / w.sum()) @ v[h, :visible]
    return out


@pytest.mark.parametrize("T,S", [(6, 6), (1, 9), (3, 8)])
def test_vectorised_attention_matches_the_loop_definition(T, S):
    q = rng.standard_normal((4, T, 5), dtype=np.float32)
    k, v = (rng.standard_normal((4, S, 5), dtype=np.float32) for _ in range(2))
    out = M.attention(q, k, v)
    assert out.dtype == np.float32 and out.shape == (4, T, 5)
    np.testing.assert_allclose(out, attention_by_loops(q, k, v), atol=1e-5)


def test_attention_is_causal_future_tokens_change_nothing_before_them():
    model = tiny_model()
    ids = [5, 17, 3, 99, 42, 8]
    full = gpt2_core.forward(model, ids)
    changed = gpt2_core.forward(model, ids[:4] + [1, 2])
    np.testing.assert_allclose(full[:4], changed[:4], atol=1e-6)
    assert not np.allclose(full[4:], changed[4:])


def test_forward_shape_dtype_and_float32_throughout():
    model = tiny_model()
    logits = gpt2_core.forward(model, [1, 2, 3])
    assert logits.shape == (3, TINY.vocab_size) and logits.dtype == np.float32


@pytest.mark.parametrize("ref_dir", reference_dirs(), ids=lambda p: p.name)
def test_logits_match_hf_transformers_on_random_reference_models(ref_dir):
    """Tolerance 1e-4 max abs: float32 with a different summation order (BLAS vs MKL) differs by ~1e-6..1e-5."""
    model = gpt2_core.load_model(ref_dir)
    ref = np.load(ref_dir / "reference.npz")
    for ids, logits in prompts(ref):
        ours = gpt2_core.forward(model, ids)
        assert np.abs(ours - logits).max() < 1e-4, f"{ref_dir.name}: max abs diff {np.abs(ours - logits).max()}"


@pytest.mark.parametrize("ref_dir", reference_dirs(), ids=lambda p: p.name)
def test_greedy_tokens_match_hf_for_32_steps(ref_dir):
    model = gpt2_core.load_model(ref_dir)
    ref = np.load(ref_dir / "reference.npz")
    ours = gpt2_core.generate(model, ref["greedy_input_ids"], 32, stop_at_eos=False)
    assert ours == ref["greedy_ids"].tolist()


def test_embedded_model_matches_hf_transformers():
    model = gpt2_core.load_model()
    ref = np.load(PACKAGE_DATA / "reference" / "embedded.npz")
    worst = 0.0
    for ids, logits in prompts(ref):
        worst = max(worst, float(np.abs(gpt2_core.forward(model, ids) - logits).max()))
    assert worst < 1e-4, f"max abs diff {worst}"
    ours = gpt2_core.generate(model, ref["greedy_input_ids"], 32, stop_at_eos=False)
    assert ours == ref["greedy_ids"].tolist()


def test_reference_files_cover_the_layouts_the_loader_must_read():
    """The parity tests above run over safetensors fp32, fp16 and a legacy .bin: make sure all three exist."""
    names = {p.name: {f.name for f in p.iterdir()} for p in reference_dirs()}
    assert any("pytorch_model.bin" in files for files in names.values())
    assert sum("model.safetensors" in files for files in names.values()) >= 2
    assert (PACKAGE_DATA / "embedded" / "model.safetensors").is_file()
