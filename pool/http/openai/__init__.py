"""OpenAI's formats over the same pool: Chat Completions, legacy Completions, Embeddings.

System and developer messages become ``instructions``; one user message becomes
single-turn ``input`` (so single-turn models work with chat clients); a longer
conversation becomes ``messages``. A legacy completion's prompt is one user turn
(rendered by the model's prompt format like any other). Errors use OpenAI's error
object.

``_parse`` reads the bodies into neutral requests, ``_render`` writes the results (and
errors) in OpenAI's shapes, ``_routes`` serves them.
"""

from pool.http.openai._routes import ROUTES, register

__all__ = ["ROUTES", "register"]
