"""``/openai/v1``: OpenAI's API exactly, its Responses API included.

OpenAI's SDKs, the Agents SDK and Codex take one base URL for everything; this one
serves ``responses`` (create, stream, retrieve, delete, input items) in OpenAI's own
shapes, and ``chat/completions``, ``completions``, ``embeddings`` and ``models`` with
the ``/v1`` handlers (``pool/http/openai/``, ``pool/http/admin/``). Errors are
OpenAI's error object (``pool/http/openai/_render.py``). ``/v1/responses`` keeps the
pool's own shape (``pool/http/responses/``).

A request becomes the pool's :class:`~pool.actors.InferenceRequest` as Chat Completions
does: system and developer messages join ``instructions``, one user message is a
single prompt, a longer conversation (with ``function_call`` and
``function_call_output`` items) needs a multi-turn model. ``previous_response_id``
puts the stored conversation (``_store.py``) before the new input.

``_parse`` reads the body into input items and the neutral request, ``_render`` builds
the response object and its stream events, ``_routes`` serves them.
"""

from pool.http.openai_responses._routes import ROUTES, register

__all__ = ["ROUTES", "register"]
