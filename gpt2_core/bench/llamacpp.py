"""The capstone's llama.cpp rows: the run's own GPT-2 weights written as GGUF files, served by llama.cpp.

llama.cpp is the CPU engine people actually run. To put it beside the series' engines on the same work, this module
writes the capstone's model (random weights of GPT-2 124M's shape) in llama.cpp's format (``write_gpt2_gguf``): its
``gpt2`` architecture, every matrix in float32 (``f32``) or in ``q8_0`` (blocks of 32 int8 numbers and one fp16
scale, 34 bytes), the GPT-2 tokenizer's vocabulary and merges (llama.cpp refuses a file without them; the rows feed
token ids, never text). ``serve_gguf`` then serves the workload one request at a time, greedy, as chapter 2's
``kv_cache`` row does, in a spawned worker process (llama.cpp's threads would compete with OpenBLAS's in the main
one, as numba's do). ``pip install llama-cpp-python`` compiles llama.cpp from source (6-8 minutes on 2 cores);
without it the capstone lists ``llamacpp`` as skipped.

HF's ``Conv1D`` keeps a weight as [in, out]; llama.cpp's ``gpt2`` reads ``attn_qkv`` as ggml ``{in, out}``, which
NumPy holds as [out, in]: every block matrix is written transposed (llama.cpp's ``convert_hf_to_gguf.py`` does the
same). ``tests/test_llamacpp.py`` reads a written file back with the ``gguf`` package and, where llama.cpp is
installed, checks its logits against chapter 1's forward.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import InvalidInputError
from ..loading.tokenizer import EOT
from ..loading.weights import GPT2_TOKENIZER_FILE, GPT2Model
from .common import in_spawned_process

GGUF_TYPES = ("f32", "q8_0")
MATRICES = {"attn_qkv": ("attn", "c_attn"), "attn_output": ("attn", "c_proj"), "ffn_up": ("mlp", "c_fc"),
            "ffn_down": ("mlp", "c_proj")}  # llama.cpp's name -> where GPT2Model keeps it
NORMS = {"attn_norm": "ln_1", "ffn_norm": "ln_2"}


def gpt2_vocabulary(tokenizer_json: str | Path | None = None) -> tuple[list[str], list[str]]:
    """GPT-2's byte-level BPE as GGUF stores it: the tokens by id and the merges (``"a b"``), from the
    package's GPT-2 ``tokenizer.json``."""
    import json

    path = Path(tokenizer_json) if tokenizer_json else GPT2_TOKENIZER_FILE
    spec = json.loads(path.read_text(encoding="utf-8"))
    vocab = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges


def gguf_unsupported(config) -> str | None:
    """Why ``write_gpt2_gguf`` cannot write a model of ``config`` for llama.cpp, or None if it can."""
    num_tokens = len(gpt2_vocabulary()[0])
    if config.vocab_size != num_tokens:
        return (f"llama.cpp needs the vocabulary of the model it runs: GPT-2's tokenizer has {num_tokens:,} tokens, "
                f"the model {config.vocab_size}")
    if config.n_embd % 32:
        return f"q8_0 packs rows in blocks of 32: n_embd={config.n_embd} is not a multiple of 32"
    return None


def write_gpt2_gguf(model: GPT2Model, path: str | Path, qtype: str = "f32") -> Path:
    """``model`` as a GGUF file llama.cpp's ``gpt2`` architecture loads; ``qtype`` ``"f32"`` or ``"q8_0"``
    (every block matrix and the embedding table in q8_0; norms, biases and positions stay float32, as llama.cpp's
    converter leaves them). The LM head is the embedding table (tied, as GPT-2's)."""
    import gguf

    if qtype not in GGUF_TYPES:
        raise InvalidInputError(f"qtype must be one of {GGUF_TYPES}, got {qtype!r}")
    cfg, p = model.config, model.params
    why = gguf_unsupported(cfg)
    if why is not None:
        raise InvalidInputError(why)
    tokens, merges = gpt2_vocabulary()
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_name("gpt2-numpy capstone (random weights)")
    w.add_context_length(cfg.n_positions)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(4 * cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_head_count(cfg.n_head)
    w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    eot = tokens.index(EOT)
    w.add_token_types([gguf.TokenType.CONTROL if i == eot else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)

    def matrix(name, a):  # a [rows, cols] as ggml {cols, rows}; q8_0 packs each row's blocks of 32
        a = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
        if qtype == "q8_0":
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # [rows, bytes]: the writer reads the shape back
        else:
            w.add_tensor(name, a)

    def vector(name, a):
        w.add_tensor(name, np.ascontiguousarray(np.asarray(a, dtype=np.float32)))

    matrix("token_embd.weight", p["wte"])  # [V, E]: ggml {E, V}, the embedding and the tied LM head
    vector("position_embd.weight", p["wpe"])  # [n_ctx, E]
    for i, block in enumerate(p["h"]):
        for name, ln in NORMS.items():
            vector(f"blk.{i}.{name}.weight", block[ln]["weight"])
            vector(f"blk.{i}.{name}.bias", block[ln]["bias"])
        for name, (module, layer) in MATRICES.items():
            matrix(f"blk.{i}.{name}.weight", np.asarray(block[module][layer]["weight"]).T)  # [in, out] -> [out, in]
            vector(f"blk.{i}.{name}.bias", block[module][layer]["bias"])
    vector("output_norm.weight", p["ln_f"]["weight"])
    vector("output_norm.bias", p["ln_f"]["bias"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class GGUFWeights:
    """What a GGUF file's weights weigh, in the shape chapter 6's ``bytes_per_token`` reads a model: ``nbytes()``,
    the config, and the two embedding tables' bytes (``params["wte"].nbytes``, ``params["wpe"].nbytes``)."""

    class _Sized:
        def __init__(self, nbytes: int):
            self.nbytes = int(nbytes)

    def __init__(self, path: str | Path, config):
        import gguf

        sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
        self.config, self._nbytes = config, sum(sizes.values())
        self.params = {"wte": self._Sized(sizes["token_embd.weight"]),
                       "wpe": self._Sized(sizes["position_embd.weight"])}

    def nbytes(self) -> int:
        return self._nbytes


def open_llama_cpp(path, n_ctx: int, n_batch: int = 512, threads: int | None = None):
    """llama-cpp-python's ``Llama`` on the GGUF file, on the CPU, quiet."""
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                 n_threads_batch=threads, n_gpu_layers=0, verbose=False)


def last_logits(llm) -> np.ndarray:
    """The logits llama.cpp computed for the last token it evaluated [V] (a copy)."""
    import llama_cpp

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()


def greedy_stream(llm, prompt_ids, max_new_tokens: int):
    """llama.cpp's greedy tokens for ``prompt_ids`` from an empty cache, one at a time (chapter 2's
    ``generate_stream``, run by llama.cpp)."""
    llm.reset()
    llm.eval([int(t) for t in prompt_ids])
    for i in range(max_new_tokens):
        token = int(last_logits(llm).argmax())
        yield token
        if i + 1 < max_new_tokens:
            llm.eval([token])


def serve_worker(conn, path: str, n_ctx: int, requests, threads: int | None) -> None:
    """Serve ``requests`` one at a time with llama.cpp (``replay.serve_one_by_one`` over ``greedy_stream``), in
    this (spawned) process; send back (their outputs, the seconds of the whole run, llama-cpp-python's version), the
    clock started after one untimed warm-up request. What it raises, ``in_spawned_process`` reports."""
    import llama_cpp

    from .replay import serve_one_by_one

    llm = open_llama_cpp(path, n_ctx, threads=threads)
    list(greedy_stream(llm, requests[0].prompt_token_ids, min(2, requests[0].max_new_tokens)))  # warm-up
    outputs, seconds = serve_one_by_one(llm, requests, lambda m, ids, n, stop_at_eos: greedy_stream(m, ids, n))
    conn.send((outputs, seconds, llama_cpp.__version__))


def serve_gguf(path, n_ctx: int, requests, threads: int | None, timeout_s: float = 3600.0):
    """``serve_worker`` in a spawned process -> (outputs, seconds, llama_cpp version); raises ``RuntimeError`` with
    the worker's exception if it failed (``in_spawned_process``)."""
    return in_spawned_process(serve_worker, (str(path), n_ctx, list(requests), threads), "llama.cpp worker",
                              timeout_s)
