"""Appendix: the seam. ``accelerate(model)`` returns the same model with its weights wrapped in ``FastWeight``s.

Chapter code multiplies as it always does (chapter 1's ``linear`` is ``x @ weight + bias``, the head
``x @ wte.T``). A ``FastWeight`` sets ``__array_ufunc__ = None``, so NumPy hands ``x @ weight`` to its
``__rmatmul__``, which picks the kernel for the number of rows: one GEMV for one row, tiles for 2-64 rows
(``tiles``), a GEMV per row or a padded GEMM without them (``small_batch``). The numbers are the same weights; two
copies change only how they lie in memory: the output projections are kept column-major (a GEMV streams them
faster here) and the tied LM head gets its own contiguous [E, V] copy (``x @ wte.T`` reads wte through a
transposed view). Every chapter runs unchanged on an accelerated model; no chapter imports this package.

Chapter 9's Llama (``LlamaModel``) is accelerated the same way: each block's seven matrices in ``FastWeight``s (kept
in their own row-major order: the column-major projections were measured on GPT-2's shapes only) and the tied
embedding's head in a ``TiedEmbedding``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..ch06_quantization.quantization import QuantizedEmbedding, QuantizedWeight
from ..ch09_modern_model.quantized import MATRICES as LLAMA_MATRICES  # a Llama block's seven matmuls
from ..loading.llama import LlamaModel
from ..loading.memory import available_memory_bytes
from ..loading.weights import GPT2Model
from .small_batch import GEMV_MAX_ROWS, HEAD_BLOCK, small_batch_matmul
from .tiles import small_kernel_here, tile_bytes, tile_weight, tiled_matmul, uses_tiles

COLUMN_MAJOR = (("attn", "c_proj"), ("mlp", "c_proj"))  # (module, layer) kept column-major


class _Wrapper:
    """What NumPy and the package read of the array inside (``self.array``): shape, dtype, sizes, and the array
    itself for ``np.asarray``. ``__array_ufunc__ = None`` makes NumPy hand ``x @ self`` to ``__rmatmul__``."""

    __array_ufunc__ = None
    array: np.ndarray
    shape = property(lambda self: self.array.shape)
    ndim = property(lambda self: self.array.ndim)
    dtype = property(lambda self: self.array.dtype)
    size = property(lambda self: self.array.size)
    nbytes = property(lambda self: self.array.nbytes)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.array, dtype=dtype)


class FastWeight(_Wrapper):
    """A weight [in, out] whose product ``x @ weight`` (x [N, in]) takes the fastest kernel for N rows.

    ``tiled``: 2 to 64 rows go through tiles of the weight, made on first use and kept (only while memory
    ``spare_bytes`` large stays free after them, else the kernels below run). ``gemv_max_rows``: without tiles,
    up to this many rows run one GEMV per row (1: always the GEMM). ``block``: the column block of per-row GEMVs.
    """

    def __init__(self, array, *, tiled: bool = True, gemv_max_rows: int = GEMV_MAX_ROWS, block: int | None = None,
                 spare_bytes: int = 0, _kept: dict | None = None):
        self.array = array  # [in, out]
        self.tiled, self.gemv_max_rows, self.block, self.spare_bytes = tiled, gemv_max_rows, block, spare_bytes
        self._kept = {} if _kept is None else _kept  # the tiles, shared with ``configured`` copies

    def configured(self, tiled: bool, gemv_max_rows: int) -> FastWeight:
        """The same weight (and tiles) with other kernel settings."""
        return FastWeight(self.array, tiled=tiled, gemv_max_rows=gemv_max_rows, block=self.block,
                          spare_bytes=self.spare_bytes, _kept=self._kept)

    def tiles(self) -> np.ndarray | None:
        """``tile_weight(array)``, made on first use; None if the memory for it is not available."""
        if "tiles" not in self._kept:
            available = available_memory_bytes()
            fits = available is None or tile_bytes(self.array) + self.spare_bytes <= available
            self._kept["tiles"] = tile_weight(self.array) if fits else None
        return self._kept["tiles"]

    def __rmatmul__(self, x):  # x [N, in] -> [N, out]
        if x.ndim != 2:
            return np.matmul(x, self.array)
        if self.tiled and uses_tiles(len(x)):
            tiles = self.tiles()
            if tiles is not None:
                return tiled_matmul(x, tiles, self.array.shape[1])
        return small_batch_matmul(x, self.array, self.gemv_max_rows, self.block)


class TiedEmbedding(_Wrapper):
    """``wte`` [V, E] of an accelerated model: rows by token id for the embedding; ``.T``, the LM head, is its own
    contiguous [E, V] ``FastWeight`` (a copy: V x E x 4 bytes)."""

    def __init__(self, wte: np.ndarray, head: FastWeight):
        self.array, self.T = wte, head

    def __getitem__(self, token_ids):
        return self.array[token_ids]


def array_of(a) -> np.ndarray:
    """The array inside a ``FastWeight`` or ``TiedEmbedding`` (``a`` itself if it is an array)."""
    return a.array if isinstance(a, (FastWeight, TiedEmbedding)) else a


def is_accelerated(model: GPT2Model | LlamaModel) -> bool:
    """Does ``model`` run the appendix's kernels (``accelerate``), i.e. hold its head as a ``TiedEmbedding``?"""
    params = model.params
    return any(isinstance(params.get(name), TiedEmbedding) for name in ("wte", "token_embd", "output"))


def default_kernels() -> dict:
    """The ``FastWeight`` settings ``accelerate(model)`` gives by default on this machine: tiles where this BLAS has
    the small-matrix kernel they need (``small_kernel_here()``), one GEMV per row up to ``GEMV_MAX_ROWS`` rows."""
    return {"tiled": small_kernel_here(), "gemv_max_rows": GEMV_MAX_ROWS}


def accelerate(model: GPT2Model | LlamaModel, tiled: bool | None = None, gemv_max_rows: int = GEMV_MAX_ROWS,
               column_major: bool = True) -> GPT2Model | LlamaModel:
    """``model`` with every matmul weight in a ``FastWeight`` (and the head in a ``TiedEmbedding``); biases, layer
    norms and position embeddings are shared with ``model``. ``tiled``, ``gemv_max_rows``: ``FastWeight``'s
    (``tiled=None``: as ``default_kernels()``, tiles where this BLAS has the small-matrix kernel they need);
    ``column_major``: keep the two output projections column-major (else as the checkpoint has them). An
    accelerated model given here gets the new kernel settings and keeps its arrays (and their order) and tiles."""
    spare = sum(array_of(a).nbytes for a in model.state_dict().values())  # tiles only while this much stays free
    if tiled is None:
        tiled = default_kernels()["tiled"]

    def fast(weight, order="C", block=None):
        if isinstance(weight, FastWeight):
            return weight.configured(tiled, gemv_max_rows)
        if isinstance(weight, (QuantizedWeight, QuantizedEmbedding)):  # chapter 6's formats keep their own kernels
            return weight
        array = np.asfortranarray(weight) if order == "F" else np.ascontiguousarray(weight)
        return FastWeight(array, tiled=tiled, gemv_max_rows=gemv_max_rows, block=block, spare_bytes=spare)

    def tied(table):  # an embedding table [V, E] whose .T is the LM head
        if isinstance(table, QuantizedEmbedding):
            return table
        # table.T: a FastWeight already, or a transposed view that fast() copies contiguous
        return TiedEmbedding(array_of(table), fast(table.T, block=HEAD_BLOCK))

    if isinstance(model, LlamaModel):
        return _accelerate_llama(model, fast, tied)
    params = dict(model.params)
    params["wte"] = tied(model.params["wte"])
    params["h"] = []
    for p in model.params["h"]:
        p = dict(p)
        for module, layers in (("attn", ("c_attn", "c_proj")), ("mlp", ("c_fc", "c_proj"))):
            p[module] = dict(p[module])
            for name in layers:
                order = "F" if column_major and (module, name) in COLUMN_MAJOR else "C"
                p[module][name] = {**p[module][name], "weight": fast(p[module][name]["weight"], order)}
        params["h"].append(p)
    return replace(model, params=params)


def _accelerate_llama(model: LlamaModel, fast, tied) -> LlamaModel:
    """``accelerate`` for chapter 9's model: the blocks' matrices, and the head ([V, E] tables used as ``.T``)."""
    params = dict(model.params)
    for name in ("token_embd", "output"):  # output: a head of its own, when the file has one
        if name in params:
            params[name] = tied(params[name])
    params["blk"] = [{k: fast(w) if k in LLAMA_MATRICES else w for k, w in p.items()} for p in model.params["blk"]]
    return replace(model, params=params)


def plain(model: GPT2Model | LlamaModel) -> GPT2Model | LlamaModel:  # the inverse of accelerate
    """``model`` with plain arrays again (the same numbers)."""
    if isinstance(model, LlamaModel):
        params = {k: array_of(v) for k, v in model.params.items() if k != "blk"}
        params["blk"] = [{k: array_of(w) for k, w in p.items()} for p in model.params["blk"]]
        return replace(model, params=params)
    params = dict(model.params, wte=array_of(model.params["wte"]))
    params["h"] = [{**p, **{m: {n: {**layer, "weight": array_of(layer["weight"])} for n, layer in p[m].items()}
                            for m in ("attn", "mlp")}} for p in model.params["h"]]
    return replace(model, params=params)
