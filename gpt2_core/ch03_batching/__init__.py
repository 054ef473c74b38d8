"""Chapter 3, batching: static batching first (``static_batching``), then continuous batching, a request's
lifecycle (``sequence``), the scheduler, the K/V store interface (``kv_store``), one ragged model step
(``model_runner``) and the engine loop (``engine``)."""
