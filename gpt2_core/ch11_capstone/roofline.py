"""The capstone's lesson: every engine against its roofline, the fastest the machine allows for the work it does.

Count the work an engine's forward passes need (``forward_flops`` per pass; ``request_passes`` and
``static_passes`` list the passes: naive recomputes every position, static computes its padding, the cached
engines compute each position once), count the bytes its steps read (``count_work``: every weight once per model
step, the K/V each decoding query reads), and price both at the machine's two limits (``roofline``): the GEMM rate
for FLOPs, the memory bandwidth for bytes; an engine needs at least the longer of the two times. One GEMM rate
flatters a step of few rows: ``per_step_bound`` prices each step an engine ran at the rate measured for its own
number of rows (``step_seconds``). The benchmark that measures every engine beside both bounds is
``gpt2_core/bench/capstone.py``.
"""

from __future__ import annotations

import numpy as np

from ..loading.config import GPT2Config




def forward_flops(config: GPT2Config, queries: int, keys: int, head_rows: int) -> int:
    """Matmul FLOPs of one sequence's forward pass over ``queries`` new positions attending to ``keys`` positions
    (the queries are the last of them), with the LM head on ``head_rows`` positions. Per layer: the four weight
    matrices (2 x 12 E^2 per position) and attention (Q K^T and P V over every key: 2 x 2 E per query and key, as
    chapter 1's ``attention`` computes the whole [T, S] score matrix, masked); the head 2 E V per row. Layer norms,
    GELU and the softmax's exponentials are not matmuls and are not counted."""
    E, L = config.n_embd, config.n_layer
    return L * (24 * E * E * queries + 4 * E * queries * keys) + 2 * E * config.vocab_size * head_rows


def request_passes(method: str, prompt_len: int, new_tokens: int) -> list[tuple[int, int, int]]:
    """The forward passes one request costs an engine that serves it alone, as (queries, keys, head_rows):
    naive runs the whole sequence for every new token; the cached engines prefill the prompt once, then decode
    one position per token (the last token is never fed back)."""
    if new_tokens == 0:
        return []
    if method == "naive":
        return [(prompt_len + i, prompt_len + i, 1) for i in range(new_tokens)]
    return [(prompt_len, prompt_len, 1)] + [(1, prompt_len + i, 1) for i in range(1, new_tokens)]


def static_passes(batch: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The passes of one static batch of (prompt_len, new_tokens) rows: every row padded to the longest prompt T
    and run until the longest row is done (a finished row is fed a pad), so each pass counts all B rows."""
    B, T, steps = len(batch), max(p for p, _ in batch), max(n for _, n in batch)
    if steps == 0:
        return []
    return [(T, T, 1)] * B + [(1, T + j, 1) for j in range(1, steps) for _ in range(B)]


def count_work(config: GPT2Config, passes, model_steps: int, weight_bytes: int,
               kv_bytes_per_position: int | None = None) -> dict:
    """FLOPs and bytes of ``passes`` ((queries, keys, head_rows) per sequence-pass) run in ``model_steps`` model
    steps: each step reads every weight once (``weight_bytes``, what a batch-1 step reads); each decoding query
    reads the K/V of its keys (``kv_bytes_per_position`` each; default float32, 2 L E floats a position: int8 K/V
    with their scales read fewer). Prefill attention reads the K/V it has just written (in cache) and is not
    charged."""
    kv_per_position = 2 * config.n_layer * config.n_embd * 4 if kv_bytes_per_position is None else kv_bytes_per_position
    flops = sum(forward_flops(config, q, k, h) for q, k, h in passes)
    kv_read = sum(k * kv_per_position for q, k, _ in passes if q == 1)
    return {"flops": int(flops), "bytes_read": int(model_steps * weight_bytes + kv_read),
            "positions": int(sum(q for q, _, _ in passes)), "model_steps": int(model_steps)}


def roofline(flops: float, bytes_read: float, output_tokens: int, flops_per_s: float, bytes_per_s: float) -> dict:
    """The fastest an engine doing this work can run: its FLOPs at the GEMM rate and its bytes at the bandwidth
    take time each; it needs at least the longer of the two. -> bound_tokens_per_s, bound_kind, and both times."""
    flop_s, byte_s = flops / flops_per_s, bytes_read / bytes_per_s
    return {"bound_tokens_per_s": output_tokens / max(flop_s, byte_s),
            "bound_kind": "flops" if flop_s >= byte_s else "bytes", "flop_seconds": flop_s, "byte_seconds": byte_s}


def workload_passes(method: str, lengths: list[tuple[int, int]], batch: int = 32) -> list:
    """Every pass of ``method`` over requests of ``lengths`` [(prompt_len, new_tokens)]: static and HF in
    batches of ``batch`` in request order (offline), the others request by request."""
    if method in ("static", "hf_transformers"):
        return [p for i in range(0, len(lengths), batch) for p in static_passes(lengths[i:i + batch])]
    return [p for P, N in lengths for p in request_passes("naive" if method == "naive" else "cached", P, N)]


# -- the bound at each step's own shape ----------------------------------------------------------------------------
# ``roofline`` prices every FLOP at one GEMM rate, measured at 256 rows. A decode step of 32 sequences multiplies 32
# rows, and a matrix library is slower per FLOP on short, wide products (each weight it streams serves fewer rows).
# The functions below price each step the engine actually ran at the rate measured for that many rows.


def rate_at(rows: int, measured_rows, rates) -> float:
    """The GEMM rate at ``rows`` rows from ``rates`` (FLOP/s) measured at ``measured_rows`` (ascending): linear in
    log2(rows) between the two measured counts around it; beyond them, the nearest one's."""
    return float(np.interp(np.log2(rows), np.log2(np.asarray(measured_rows, dtype=float)), rates))


def step_seconds(config: GPT2Config, chunks, weight_bytes: int, rates: dict, bytes_per_s: float,
                 kv_bytes_per_position: int | None = None) -> tuple[float, float]:
    """The least time one engine step can take, as (FLOP seconds, byte seconds). ``chunks``: the step's
    sequences as (queries, keys, head_rows). ``rates``: FLOP/s measured in the run on the model's own matrices,
    ``{"rows": [...], "blocks": [...], "head_rows": [...], "head": [...]}``. FLOPs: the block matmuls on all N
    rows of the step at the block rate for N rows, the LM head on its rows at the head's rate for that many rows,
    attention (the ``4 E`` per query, key and layer of ``forward_flops``) at the best block rate measured (a bound
    for it). Bytes: every weight once, and the K/V of the keys cached before the step (the step's own K/V are
    written and read while in cache)."""
    E, L, V = config.n_embd, config.n_layer, config.vocab_size
    kv = 2 * L * E * 4 if kv_bytes_per_position is None else kv_bytes_per_position
    N, R = sum(q for q, _, _ in chunks), sum(h for _, _, h in chunks)
    flop_s = 24 * E * E * L * N / rate_at(N, rates["rows"], rates["blocks"])
    flop_s += 2 * E * V * R / rate_at(R, rates["head_rows"], rates["head"]) if R else 0.0
    flop_s += 4 * E * L * sum(q * k for q, k, _ in chunks) / max(rates["blocks"])
    byte_s = (weight_bytes + kv * sum(k - q for q, k, _ in chunks)) / bytes_per_s
    return flop_s, byte_s


def per_step_bound(config: GPT2Config, steps, weight_bytes: int, rates: dict, bytes_per_s: float,
                   output_tokens: int, kv_bytes_per_position: int | None = None) -> dict:
    """The fastest an engine could have run the steps it ran (``steps``: each a list of chunks, as
    ``step_seconds`` takes them): each step takes at least the longer of its FLOP and byte times at its own shape;
    the steps add up. -> step_bound_tokens_per_s, step_bound_seconds, steps_bound_by_bytes."""
    times = [step_seconds(config, chunks, weight_bytes, rates, bytes_per_s, kv_bytes_per_position)
             for chunks in steps]
    total = sum(max(f, b) for f, b in times)
    return {"step_bound_tokens_per_s": output_tokens / total if total else float("inf"),
            "step_bound_seconds": total, "steps_bound_by_bytes": sum(b > f for f, b in times)}
