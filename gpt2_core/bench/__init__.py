"""Benchmarks and the tools they measure with (commands, not tests): ``python -m gpt2_core bench NAME``.

``common``: medians, interleaved arms, peak memory, the machine's description. ``workload`` and ``replay``: request
traces and feeding them to an engine at their arrival times. One module per benchmark: ``kv_cache`` (chapter 2,
with the machine's bandwidth bound), ``batching`` (chapter 3, with the GEMM bound and the appendix's kernel
comparisons), ``paged`` (chapter 4), ``layout`` (the appendix); ``registry`` names them for the command line.
Every benchmark runs the chapters' code on ``cpu_kernels.accelerate``'s kernels and says so in its JSON.
"""
