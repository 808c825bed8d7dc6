"""Rerank and score: ``/v1/rerank`` (also ``/rerank``, ``/v2/rerank``, ``/openai/v1/rerank``)
in the shape llama.cpp, vLLM, Jina and Cohere clients send, and vLLM's ``/v1/score``.

A request becomes one :class:`~pool.backends.RerankJob` (``_core``), checked against
``engine.rerank`` and run through the pool as any task: keys, tenants, rate limits,
budgets, the queue, usage rows and traces. ``_routes`` declares and serves the routes;
errors are OpenAI's error object.
"""

from pool.http.rerank._core import rerank_reply, score_reply
from pool.http.rerank._routes import ROUTES, register

__all__ = ["ROUTES", "register", "rerank_reply", "score_reply"]
