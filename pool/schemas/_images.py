"""``POST /v1/images/generations``: OpenAI's image generation, forwarded to a model of
kind ``image`` (backend ``server``) as the client sent it.

The request model types what the pool reads (``model``) and what clients commonly send;
every other field goes on to the server untouched, so a server's own options pass.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from pool.schemas._compat import ModelName, Text


class ImageGenerationRequest(BaseModel):
    """OpenAI's image generation body; fields beyond these reach the server as they are."""

    model_config = ConfigDict(extra="allow")

    model: ModelName
    prompt: Text = Field(description="What to draw.")
    n: Annotated[int, Field(ge=1, le=128)] | None = Field(None, description="How many images.")
    size: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        None, description="`WIDTHxHEIGHT`, as the server takes it."
    )
    response_format: Literal["url", "b64_json"] | None = None
    quality: Annotated[str, StringConstraints(max_length=64)] | None = None
    style: Annotated[str, StringConstraints(max_length=64)] | None = None
    stream: bool | None = Field(
        None, description="Where the server streams (Server-Sent Events), so does the pool."
    )
    user: Annotated[str, StringConstraints(max_length=512)] | None = None


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class ImageData(_Reply):
    url: str | None = None
    b64_json: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(_Reply):
    """The server's answer, relayed as it came."""

    created: int
    data: list[ImageData]
