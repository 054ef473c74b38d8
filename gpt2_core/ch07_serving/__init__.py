"""Chapter 7, serving: the engine over HTTP (the ``serve`` extra), ``python -m gpt2_core serve``.

* ``protocol``: the OpenAI completions request checked field by field, the streamed text (a linear stop-string
  matcher), the errors;
* ``engine_loop``: the one thread that owns the engine, fed through a queue;
* ``metrics``: the Prometheus metrics; ``http_metrics``: every HTTP request counted and timed;
* ``middleware``: what every route goes through (request ids, access log, API key, CORS, JSON only, body limit,
  OpenAI-shaped errors);
* ``app``: the Starlette app and the command that serves it with uvicorn;
* ``chat``: the chat completions API (a conversation rendered with the model's chat template, then a completion);
* ``utility_routes``: ``/tokenize``, ``/detokenize``, ``/version``, ``/v1/models/{id}``;
* ``priority_scheduler``: the scheduling policy it adds (priorities, with aging), plain Python.
"""
