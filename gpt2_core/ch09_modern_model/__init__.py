"""Chapter 9, a modern model: SmolLM2-135M-Instruct, a Llama, through the same engine. Chapter 1's forward with four
swaps (``model``: RMSNorm, RoPE, SwiGLU, grouped-query attention), its KV-cached forward over chapter 2's cache and
chapter 3's model step for this architecture, registered so that chapter 2's generation loop and every engine run
it; what the KV cache costs by architecture (``memory``); chapter 6's formats and kernels on this model
(``quantized``). The file comes from PyPI and is read by ``loading.gguf`` / ``loading.llama``."""

from . import model  # noqa: F401  registers the Llama forwards in chapter 2's CACHED_FORWARDS, chapter 3's MODEL_STEPS
