"""GPT-2 inference in NumPy, one chapter at a time.

The public API, stable across chapters:

* ``load_model(name_or_path=None)`` / ``random_model(name_or_config, seed=0)`` -> ``GPT2Model`` (a ``.gguf`` file or
  ``"smollm2-135m-instruct"``: a ``LlamaModel``, chapter 9)
* ``forward(model, token_ids) -> logits [T, V]`` (chapter 1)
* ``generate(model, token_ids, max_new_tokens, temperature=0, top_k=None, top_p=None, seed=None)`` and
  ``generate_stream(...)`` (chapter 1's naive loop)
* ``model.tokenizer.encode(text)`` / ``.decode(ids)`` (``Tokenizer``)
"""

from .ch02_kv_cache import kv_cache  # chapter 2 (its generate has chapter 1's signature)
from .loading.config import PRESETS, GPT2Config
from .errors import CheckpointError, GPT2Error, InvalidInputError
from .ch01_forward.generation import generate, generate_stream
from .ch01_forward.model import forward
from .ch01_forward.sampling import SamplingParams
from . import ch09_modern_model  # noqa: F401  chapter 9 registers the Llama model step, so every engine runs it
from .loading.tokenizer import Tokenizer
from .loading.weights import GPT2Model, load_model, random_model

__version__ = "0.1.0"

__all__ = [
    "GPT2Config", "PRESETS", "GPT2Error", "CheckpointError", "InvalidInputError", "GPT2Model", "load_model",
    "random_model", "forward", "generate", "generate_stream", "SamplingParams", "Tokenizer", "kv_cache",
]
