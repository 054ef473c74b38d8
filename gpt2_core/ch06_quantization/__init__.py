"""Chapter 6, quantization: weights in fp16, int8 or int4 behind chapter 1's ``x @ W`` (``quantization``), the KV
cache in fewer bytes (``quant_kv_store``), and matmuls that read the small weights directly (``quant_kernels``,
the optional ``kernels`` extra)."""
