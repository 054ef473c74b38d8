"""Chapter 1: the GPT-2 forward pass as plain NumPy functions.

One function per formula, a shape comment on each line. Shapes: T = tokens in the sequence, S = keys attended
to (S == T here; later chapters attend to cached keys too), E = n_embd, H = n_head, D = head_dim = E // H,
V = vocab_size. Everything is float32: a float64 constant would silently promote the activations and make every
matmul run on float64 copies of the weights (several times slower), so constants are np.float32.

Parameters are nested dicts named like the checkpoint keys (``h.0.attn.c_attn.weight`` is
``params["h"][0]["attn"]["c_attn"]["weight"]``); see ``gpt2_core.loading.weights``.
"""

from __future__ import annotations

import numpy as np

from ..loading.weights import GPT2Model

GELU_C = np.float32(np.sqrt(2.0 / np.pi))  # float32, so x stays float32


def gelu(x):
    """GPT-2's tanh approximation of GELU ("gelu_new" in HF).

    ``x * x * x``, not ``x**3``: NumPy's float32 power is a general ``powf`` call, much slower than two multiplies.
    """
    return 0.5 * x * (1 + np.tanh(GELU_C * (x + np.float32(0.044715) * (x * x * x))))


def softmax(x, axis=-1):
    """Numerically stable: subtracting the row max changes nothing mathematically and keeps exp() finite."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def layer_norm(x, weight, bias, eps):  # x [T, E]; weight, bias [E]
    """Each row scaled to mean 0 and variance 1, then by ``weight`` and shifted by ``bias``."""
    centred = x - x.mean(axis=-1, keepdims=True)  # [T, E]
    var = (centred * centred).mean(axis=-1, keepdims=True)  # [T, 1] (biased variance, as torch's LayerNorm)
    return weight * centred / np.sqrt(var + np.float32(eps)) + bias  # [T, E]


def linear(x, weight, bias):  # x [T, in]; weight [in, out] (HF Conv1D layout); bias [out]
    return x @ weight + bias  # [T, out]


def split_heads(x, n_head):  # x [T, E] -> [H, T, D]
    T, E = x.shape
    return x.reshape(T, n_head, E // n_head).transpose(1, 0, 2)


def split_qkv(qkv, n_head):  # qkv [T, 3E] -> q, k, v [H, T, D] each
    """Q, K and V lie side by side in c_attn's output, each [T, E] made of H heads of D: one reshape and one
    transpose split all three and their heads at once, as views of ``qkv`` (``np.split`` into three, then
    ``split_heads`` on each, gives the same arrays)."""
    T, E3 = qkv.shape
    return qkv.reshape(T, 3, n_head, E3 // (3 * n_head)).transpose(1, 2, 0, 3)  # [3, H, T, D]


def merge_heads(x):  # x [H, T, D] -> [T, E]
    H, T, D = x.shape
    return x.transpose(1, 0, 2).reshape(T, H * D)


def attention(q, k, v):  # q [H, T, D]; k, v [H, S, D] with S >= T -> [H, T, D]
    """Causal scaled dot-product attention, all heads at once.

    The T queries are the *last* T positions of the S keys, so query i may see keys 0 .. S - T + i. With S == T
    that is the usual lower-triangular mask; with one query (decoding, chapter 2) nothing is masked.
    """
    T, S, D = q.shape[1], k.shape[1], q.shape[2]
    scores = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(D))  # [H, T, S]
    if T > 1:  # one query is the last position and sees every key: nothing to mask
        visible = np.arange(S)[None, :] <= np.arange(S - T, S)[:, None]  # [T, S] True where key j is not in the future
        scores = np.where(visible, scores, np.float32(-np.inf))  # [H, T, S]
    return softmax(scores) @ v  # [H, T, D]


def decode_attention(q, k, v):  # q [H, 1, D] already scaled by 1/sqrt(D); k, v [H, S, D] -> [H, 1, D]
    """Chapter 1's ``attention`` for a single query (the last position: it sees every key, no mask), fused: the
    query arrives scaled and the softmax is normalised after the product with V, dividing an [H, 1, D] array
    instead of the [H, 1, S] scores. A batch of 32 decoding sequences makes 32 such calls per layer."""
    s = q @ k.transpose(0, 2, 1)  # [H, 1, S]
    e = np.exp(s - s.max(axis=-1, keepdims=True))  # [H, 1, S]
    return (e @ v) / e.sum(axis=-1, keepdims=True)  # [H, 1, D]


def causal_self_attention(x, attn, n_head):  # x [T, E] -> [T, E]
    qkv = linear(x, **attn["c_attn"])  # [T, 3E]: Q, K and V side by side (HF's fused c_attn)
    q, k, v = split_qkv(qkv, n_head)  # 3 x [H, T, D]
    out = attention(q, k, v)  # [H, T, D]
    return linear(merge_heads(out), **attn["c_proj"])  # [T, E]


def mlp(x, mlp_params):  # x [T, E] -> [T, E]
    h = gelu(linear(x, **mlp_params["c_fc"]))  # [T, 4E]
    return linear(h, **mlp_params["c_proj"])  # [T, E]


def block(x, p, n_head, eps):  # x [T, E] -> [T, E]: one pre-LN transformer block
    x = x + causal_self_attention(layer_norm(x, **p["ln_1"], eps=eps), p["attn"], n_head)  # [T, E]
    x = x + mlp(layer_norm(x, **p["ln_2"], eps=eps), p["mlp"])  # [T, E]
    return x


def embed(params, token_ids, start_pos=0):  # token_ids [T] -> [T, E]
    positions = np.arange(start_pos, start_pos + len(token_ids))  # [T]
    return params["wte"][token_ids] + params["wpe"][positions]  # [T, E]


def lm_head(params, x, eps):  # x [T, E] -> logits [T, V]
    x = layer_norm(x, **params["ln_f"], eps=eps)  # [T, E]
    return x @ params["wte"].T  # [T, V]: the output layer is the token embedding, transposed ("tied")


def transformer(model: GPT2Model, token_ids) -> np.ndarray:  # token_ids [T] -> hidden states [T, E]
    cfg, params = model.config, model.params
    token_ids = model.check_tokens(token_ids)  # [T] int64; clear errors for empty, too long, out of range
    x = embed(params, token_ids)  # [T, E]
    for p in params["h"]:
        x = block(x, p, cfg.n_head, cfg.layer_norm_epsilon)  # [T, E]
    return x


def forward(model: GPT2Model, token_ids) -> np.ndarray:
    """Logits for every position of ``token_ids``: [T, V]. Recomputes everything from the tokens up."""
    return lm_head(model.params, transformer(model, token_ids), model.config.layer_norm_epsilon)  # [T, V]
