"""Request bodies of the client-compatibility surfaces: OpenAI Chat Completions and Ollama.

These accept (and ignore) the many optional fields real clients send; the fields the
pool acts on are typed and bounded like the native API's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    field_validator,
    model_validator,
)

from pool.config import (
    LOGIT_BIAS_DESCRIPTION,
    ClientTemperature,
    LogitBias,
    MaxTokens,
    MinP,
    Penalty,
    RepetitionPenalty,
    StopString,
    Temperature,
    TopK,
    TopP,
)
from pool.schemas._documented import OLLAMA_FORMAT
from pool.schemas._responses import MAX_ITEMS, MAX_TEXT_CHARS, ImageUrl
from pool.schemas._tools import (
    MAX_TOOLS,
    ChatTool,
    ChatToolCall,
    ChatToolChoice,
    KeepAlive,
    OllamaToolCall,
    ResponseFormat,
)

# Ollama's images: base64 (standard alphabet, padded), as pool/http/ollama reads them.
Base64Image = Annotated[
    str,
    StringConstraints(
        max_length=MAX_TEXT_CHARS,
        pattern=r"^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",
    ),
]
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
Stop = StopString


ALLOW_REMOTE_DESCRIPTION = (
    "Pool extension: consent to send this request to a remote API; not needed for a model"
    " the operator consented for (`allow_remote: true` on the model)."
)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ChatTextPart(_Lenient):
    type: Literal["text"]
    text: Text


class ChatImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: (
        Text
        | Annotated[
            list[Annotated[ChatTextPart | ChatImagePart, Field(discriminator="type")]],
            Field(min_length=1, max_length=MAX_ITEMS),
        ]
        | None
    ) = None
    tool_calls: Annotated[list[ChatToolCall], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="An assistant message's calls (the conversation's history)."
    )
    tool_call_id: Annotated[str, StringConstraints(max_length=256)] | None = Field(
        None, description="A `tool` message: the id of the call it answers."
    )


class StreamOptions(_Lenient):
    include_usage: bool = False


ModelName = Annotated[str, StringConstraints(min_length=1, max_length=512)]
MAX_EMBED_INPUTS = 2048


class OpenAISampling(_Lenient):
    """Sampling fields OpenAI's APIs share; each one a backend cannot honour is a 400."""

    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = Field(None, description=LOGIT_BIAS_DESCRIPTION)
    min_p: MinP | None = Field(None, description="Pool extension (as llama.cpp and vLLM take it).")
    repetition_penalty: RepetitionPenalty | None = Field(
        None, description="Pool extension (as vLLM takes it)."
    )
    keep_alive: KeepAlive = Field(
        None, description="Ollama's keep_alive, for on-demand models (seconds or a duration)."
    )


class ChatCompletionRequest(OpenAISampling):
    """``POST /v1/chat/completions`` (OpenAI format)."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_ITEMS)]
    temperature: ClientTemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = Field(None, description="Only 1 is supported.")
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None,
        description="Functions the model may call; a model that cannot call tools answers"
        " 400 `tools_unsupported`.",
    )
    tool_choice: ChatToolChoice | None = Field(
        None,
        description='"auto" (default with tools), "none", "required", or'
        ' {"type": "function", "function": {"name": ...}} to force that call.',
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call per reply.")
    response_format: ResponseFormat | None = Field(
        None,
        description="`json_object` or `json_schema` (constrained decoding where the backend"
        " has it; else 400 `structured_output_unsupported`).",
    )


class CompletionRequest(OpenAISampling):
    """``POST /v1/completions`` (OpenAI's legacy text completions)."""

    model: ModelName
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=16)] = Field(
        description="One prompt, or several (one choice each; streamed only for one)."
    )
    temperature: ClientTemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    max_tokens: MaxTokens | None = 16
    stop: Stop | Annotated[list[Stop], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Not Literal[False]: that would take 0 for false, which the schema's const refuses.
    echo: StrictBool = Field(
        False, description="Only false is supported.", json_schema_extra={"const": False}
    )

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("only false is supported")
        return value

    logprobs: Annotated[int, Field(ge=0, le=5)] | None = Field(
        None, description="A 400 logprobs_unsupported: no backend here reports them yet."
    )
    n: Annotated[int, Field(ge=1, le=1)] | None = Field(None, description="Only 1 is supported.")
    suffix: None = Field(None, description="Not supported.")
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)


class EmbeddingsRequest(_Lenient):
    """``POST /v1/embeddings`` (OpenAI format)."""

    model: ModelName
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=65_536)] | None = None
    user: str | None = None
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)
    keep_alive: KeepAlive = None


# The most documents (or score pairs) the schema takes; the pool's own bound,
# `engine.rerank.max_documents`, is lower by default (400 `too_many_documents`).
MAX_RERANK_DOCUMENTS = 100_000
RERANK_RETURN_DOCUMENTS = (
    'Each result carries its document (`{"text"}`) as well as its index; default false,'
    " as Cohere's v2 API."
)


class RerankDocument(_Lenient):
    """A document as an object (Jina's and Cohere's clients send ``{"text": ...}``)."""

    text: Text


class RerankRequest(_Lenient):
    """``POST /v1/rerank`` (also ``/rerank``, ``/v2/rerank``): the shape llama.cpp, vLLM,
    Jina and Cohere clients send."""

    model: ModelName
    query: Text
    documents: Annotated[
        list[Text | RerankDocument], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)
    ]
    top_n: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Answer the best `top_n` results only; default: every document."
    )
    return_documents: bool = Field(False, description=RERANK_RETURN_DOCUMENTS)
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)
    keep_alive: KeepAlive = None


ScoreText = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]


class ScoreRequest(_Lenient):
    """``POST /v1/score`` (vLLM's): ``text_1`` scored against each of ``text_2``, or the
    two lists pair by pair (then of one length)."""

    model: ModelName
    text_1: ScoreText
    text_2: ScoreText
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)
    keep_alive: KeepAlive = None


# OpenAI's formats of ``POST /v1/audio/speech``; the pool writes `wav` and `pcm` itself
# and the others with PyAV, refusing one whose encoder is missing (400
# `response_format_unsupported`).
SpeechFormat = Literal["wav", "pcm", "mp3", "opus", "aac", "flac"]


class SpeechRequest(_Lenient):
    """``POST /v1/audio/speech`` (OpenAI format)."""

    model: ModelName
    input: Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)] = Field(
        description="The text to say; a model takes at most its `max_input_characters`"
        " (4096 by default, else 400 `input_too_long`)."
    )
    voice: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = Field(
        None,
        description="One of the model's voices (`GET /v1/audio/voices`); unset: its first."
        " Another name is a 400 `unknown_voice`.",
    )
    response_format: SpeechFormat = Field(
        "wav",
        description="`wav` (16-bit mono) or `pcm` (raw 16-bit little-endian mono at the"
        " model's rate, `X-Sample-Rate`), or encoded in-process by PyAV: `mp3`, `opus` (Ogg,"
        " 48 kHz), `aac` (ADTS), `flac`; one whose encoder this PyAV lacks is a 400"
        " `response_format_unsupported`.",
    )
    speed: Annotated[float, Field(ge=0.25, le=4.0)] = Field(
        1.0, description="1.0 is the voice's own pace; 2.0 twice as fast."
    )
    stream_format: Literal["audio"] = Field(
        "audio", description="Only `audio` (the audio itself); OpenAI's `sse` is not served."
    )
    instructions: Annotated[str, StringConstraints(max_length=4096)] | None = Field(
        None, description="Accepted for OpenAI's clients; Piper voices cannot follow them."
    )
    stream: bool = Field(
        True,
        description="Pool extension: send the audio as it is made, sentence by sentence"
        " (a WAV header then has open sizes, as streamed WAV does); `false` answers the"
        " whole file once it is made, with exact sizes and `Content-Length`.",
    )
    keep_alive: KeepAlive = None
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)


class OllamaEmbedRequest(_Lenient):
    """``POST /api/embed``: one text or several."""

    model: ModelName
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1, le=65_536)] | None = None
    keep_alive: KeepAlive = None
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)


class OllamaEmbeddingsRequest(_Lenient):
    """``POST /api/embeddings``: Ollama's older single-text endpoint."""

    model: ModelName
    prompt: Text
    keep_alive: KeepAlive = None
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)


class OllamaCopyRequest(_Lenient):
    """``POST /api/copy``."""

    source: ModelName
    destination: ModelName


class OllamaOptions(_Lenient):
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    num_predict: Annotated[int, Field(ge=-2, le=1_000_000)] | None = None
    stop: Annotated[list[Stop], Field(max_length=16)] | None = None
    repeat_penalty: RepetitionPenalty | None = None
    num_ctx: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    min_p: MinP | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None


class OllamaMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    tool_calls: Annotated[list[OllamaToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_name: Annotated[str, StringConstraints(max_length=256)] | None = Field(
        None, description="A `tool` message: the function whose result it is."
    )
    images: Annotated[list[Base64Image], Field(max_length=16)] | None = None


class OllamaChatRequest(_Lenient):
    model: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    messages: Annotated[list[OllamaMessage], Field(max_length=MAX_ITEMS)] = Field(
        default_factory=list
    )
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    keep_alive: KeepAlive = None
    format: Any = Field(
        None,
        description='"json" or a JSON schema the reply must follow.',
        json_schema_extra=OLLAMA_FORMAT,
    )
    think: bool | None = None
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="Functions the model may call (OpenAI's tool objects)."
    )


class OllamaGenerateRequest(_Lenient):
    model: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    prompt: Text = ""
    system: Text | None = None
    images: Annotated[list[Base64Image], Field(max_length=16)] | None = None
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    keep_alive: KeepAlive = None
    think: bool | None = None
    allow_remote: bool = Field(False, description=ALLOW_REMOTE_DESCRIPTION)
    format: Any = Field(
        None,
        description='"json" or a JSON schema the reply must follow.',
        json_schema_extra=OLLAMA_FORMAT,
    )


# Either of the two names of a model, for the schema (the validator below checks it).
_ONE_NAME: dict[str, Any] = {
    "anyOf": [
        {"required": [name], "properties": {name: {"type": "string"}}} for name in ("model", "name")
    ]
}


class OllamaModelRequest(_Lenient):
    """``/api/show``: ``model`` (or the older ``name``)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_ONE_NAME)

    model: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = None
    name: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = None

    @model_validator(mode="after")
    def _named(self) -> Self:
        if self.model is None and self.name is None:
            raise ValueError("name the model in `model` (or `name`)")
        return self

    @property
    def target(self) -> str:
        return self.model or self.name or ""


# A name the model store takes as a folder: 1-128 letters, digits, '.', '_', ':' or '-',
# starting with a letter or digit, no '..' (pool/pulls/_store.py checks the same).
StoreName = Annotated[
    str,
    StringConstraints(
        max_length=128, pattern=r"^[A-Za-z0-9](?:[A-Za-z0-9_:-]|\.[A-Za-z0-9_:-])*\.?$"
    ),
]


class OllamaStoreRequest(OllamaModelRequest):
    """``/api/pull``, ``/api/delete``: a model of the store, named as the store names it."""

    model: StoreName | None = None
    name: StoreName | None = None
    stream: bool = Field(True, description="`/api/pull`: NDJSON progress; false: the end.")
    insecure: bool = Field(False, description="Accepted and ignored, as Ollama's clients send it.")
