"""Chapter 2, the KV cache: prefill the prompt once, then decode one token per step against cached K and V."""
