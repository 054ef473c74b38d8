"""The capstone: every engine of the series on one workload, each beside its roofline (``roofline``: the work
counted, priced at the GEMM rate and the memory bandwidth). Its benchmark is ``bench/capstone.py``."""
