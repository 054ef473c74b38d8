"""Chapter 9: chapter 6's weight formats and kernels on this architecture.

Chapter 6's ``quantize_model`` walks GPT-2's parameters; a Llama names them differently, so this is the same walk
over ``params["blk"][i]``: each block's seven matrices in the format, the norms in float32, and (``embeddings``)
the token embedding as chapter 6's ``QuantizedEmbedding``, one array for the lookup and the tied LM head. The
forward pass does not change: ``x @ w`` hands each product to the format's kernel (chapter 6's seam).

The file's Q4_1 is chapter 6's int4 with groups of 32 plus a minimum per group; chapter 6's int4 (symmetric, a
float32 scale per group) with ``group_size=32`` takes the same 5 bits a weight, and its numba kernel reads them
directly. The weights are requantized from the dequantized float32 ones (a second rounding, on top of the file's).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..ch06_quantization.quantization import (QuantizedEmbedding, check_format, check_group_size, quantize_weight,
                                              resolve_kernel)
from ..errors import InvalidInputError
from ..loading.llama import LlamaModel

MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # each block's matmuls
GROUP_SIZE = 32  # the file's own blocks: 32 numbers


def quantize_llama(model: LlamaModel, fmt: str = "int4", group_size: int = GROUP_SIZE, kernel: str = "numpy",
                   embeddings: bool = False) -> LlamaModel:
    """``model`` with every block's matrices in ``fmt`` (chapter 6's ``"fp16"``, ``"int8"`` or ``"int4"``), the
    embedding and LM head too if ``embeddings``; ``kernel`` as in chapter 6's ``quantize_model``."""
    check_format(fmt)
    if not isinstance(model, LlamaModel):
        raise InvalidInputError(f"quantize_llama takes a LlamaModel, got {type(model).__name__}")
    if not isinstance(embeddings, bool):
        raise InvalidInputError(f"embeddings must be True or False, got {embeddings!r}")
    if fmt == "fp32":
        return model
    cfg = model.config
    if fmt == "int4":
        for inputs in (cfg.n_embd, cfg.intermediate_size):  # every matrix's inputs are E or F
            check_group_size(group_size, inputs)
    kernel = resolve_kernel(kernel, fmt)

    def q(w):  # [in, out] float32 -> the format, multiplied by ``kernel``
        return quantize_weight(np.asarray(w, dtype=np.float32), fmt, group_size).with_kernel(kernel)

    params = dict(model.params)
    if embeddings:
        for name in ("token_embd", "output"):  # [V, E]; the head is x @ it.T (the tied one, or its own)
            if name in params:
                params[name] = QuantizedEmbedding(q(np.asarray(params[name], dtype=np.float32).T))
    params["blk"] = [{k: q(w) if k in MATRICES else w for k, w in p.items()} for p in model.params["blk"]]
    return replace(model, params=params, source=f"{model.source} ({fmt}{' + token_embd' if embeddings else ''})")
