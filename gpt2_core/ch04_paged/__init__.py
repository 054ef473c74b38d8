"""Chapter 4, the paged KV cache: fixed-size blocks, block tables and an allocator with reference counts
(``block_manager``), behind chapter 3's store interface (``paged_kv_store``); preemption when blocks run out."""
