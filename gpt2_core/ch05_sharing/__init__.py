"""Chapter 5, sharing the cache: attention that reads blocks in place (``paged_attention``), prefix caching
(``prefix_cache``), ``n`` samples by forking, prompts in chunks beside the decodes (``chunked_prefill``), and
chapter 3's engine over all of it (``caching_engine``)."""
