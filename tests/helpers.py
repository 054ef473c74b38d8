"""Small shared helpers for the tests: tiny configs and writing checkpoints in HF layout with NumPy only."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np

from gpt2_core import GPT2Config, random_model

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"  # build scripts, the random models' references, benchmarks, traces
REFERENCE = DATA / "reference"
PACKAGE_DATA = ROOT / "gpt2_core" / "data"  # what the package reads at run time (in the wheel too)

TINY = GPT2Config(vocab_size=101, n_positions=16, n_embd=24, n_head=3, n_layer=2, eos_token_id=100)


def tiny_model(seed=0, config=TINY):
    """A random model whose weights are large enough that logits differ clearly between tokens."""
    model = random_model(config, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for key, a in model.state_dict().items():
        a[...] = rng.standard_normal(a.shape, dtype=np.float32) * np.float32(0.3 if "ln_" not in key else 0.1) + (
            np.float32(1) if "ln_" in key and key.endswith("weight") else np.float32(0))
    return model


def config_json(config: GPT2Config) -> dict:
    return {"model_type": "gpt2", "activation_function": "gelu_new", "vocab_size": config.vocab_size,
            "n_positions": config.n_positions, "n_embd": config.n_embd, "n_head": config.n_head,
            "n_layer": config.n_layer, "layer_norm_epsilon": config.layer_norm_epsilon,
            "eos_token_id": config.eos_token_id, "bos_token_id": config.eos_token_id}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], bf16: bool = False) -> None:
    """A .safetensors file written by hand (the format is 8 bytes + JSON + raw bytes), BF16 optional."""
    header, chunks, offset = {}, [], 0
    for name, a in tensors.items():
        if bf16 and a.dtype == np.float32:
            raw = (np.ascontiguousarray(a).view(np.uint32) >> 16).astype("<u2").tobytes()
            dtype = "BF16"
        else:
            raw = np.ascontiguousarray(a).tobytes()
            dtype = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int32"): "I32",
                     np.dtype("float64"): "F64", np.dtype("int64"): "I64"}[a.dtype]
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def write_checkpoint(directory: Path, model, tensors: dict[str, np.ndarray] | None = None, **kwargs) -> Path:
    """config.json + model.safetensors for ``model`` (or for an edited copy of its tensors)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_json(model.config)))
    write_safetensors(directory / "model.safetensors", model.state_dict() if tensors is None else tensors, **kwargs)
    return directory


def reference_dirs() -> list[Path]:
    return sorted(p for p in REFERENCE.iterdir() if (p / "reference.npz").is_file())


def prompts(npz) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(npz[f"input_ids_{i}"], npz[f"logits_{i}"]) for i in range(int(npz["num_prompts"]))]


def run_counted_state_machine(machine, max_examples: int, steps: int, min_operations: int) -> int:
    """Run a hypothesis state machine deterministically (the same examples every run, no example database) and
    check that its rules did at least ``min_operations`` operations (the class counts them in ``operations``)."""
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    machine.operations = 0
    run_state_machine_as_test(machine, settings=settings(max_examples=max_examples, stateful_step_count=steps,
                                                         derandomize=True, deadline=None, database=None))
    assert machine.operations >= min_operations, machine.operations
    return machine.operations


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


CHAT = [{"role": "system", "content": "You answer as Jane Austen would."},  # a conversation the chat tests send
        {"role": "user", "content": "Who is Emma Woodhouse?"}]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_model_folder(folder: Path) -> Path:
    """``folder`` with the embedded model's files and a tokenizer_config.json that adds a ChatML template: the same
    model (the same greedy text), which chat requests can be sent to."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(PACKAGE_DATA / "embedded" / name, folder)
    config = json.loads((PACKAGE_DATA / "embedded" / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return folder
