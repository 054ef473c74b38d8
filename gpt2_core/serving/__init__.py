"""Serving the engine over HTTP (the ``serve`` extra): ``python -m gpt2_core serve``.

* ``protocol``: the OpenAI completions request checked field by field, the streamed text, the errors;
* ``engine_loop``: the one thread that owns the engine, fed through a queue;
* ``metrics``: the Prometheus metrics;
* ``app``: the Starlette app and the command that serves it with uvicorn.

The scheduling policy it adds (priorities, with aging) is ``gpt2_core.priority_scheduler``.
"""

from ..errors import MissingDependencyError

try:
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(f"serving needs the serve extra (pip install -e '.[serve]'): {e}") from None
