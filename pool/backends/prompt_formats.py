"""Prompt formats: how a neutral request becomes one prompt string for a completion API.

Every format is a small class of the same shape: whether it takes a multi-turn
conversation, whether it can switch thinking per request, and ``render``. The
``model_template`` format runs the chat template shipped inside a model file. That
template is untrusted input, so it runs in the sandbox of ``_template_sandbox``, with
limits on the size of every value it builds, on the work it may do and on its output.

Formats whose model family has a tool-calling convention render the offered tools,
the conversation's earlier calls and their results in that family's own markup
(``tool_family`` names the markup, which the backend parses the reply with); the
others refuse tools with ``tools_unsupported``.

The built-in formats leave the BOS token out: runtimes add it when they tokenize
(llama.cpp does for models whose tokenizer asks for it), and a second one only
confuses the model. For the same reason a model template's leading BOS is dropped
when the model's tokenizer adds its own.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

from pool.backends._protocol import (
    ALL_THINKING_MODES,
    GenerationRequest,
    TextPart,
    ThinkingMode,
    Turn,
)
from pool.backends._template_sandbox import SandboxedTemplate, TemplateLimitError
from pool.backends._tool_calls import ToolCallFamily
from pool.backends._tools import ToolCall, ToolSpec
from pool.config import PromptFormatName
from pool.errors import PoolError

__all__ = [
    "PROMPT_FORMAT_NAMES",
    "Gemma4Format",
    "GenericFormat",
    "MistralFormat",
    "ModelTemplate",
    "ModelTemplateFormat",
    "PromptFormat",
    "Qwen3Format",
    "RenderedPrompt",
    "TranslateGemmaFormat",
    "format_renders_tools",
    "format_tool_family",
    "format_traits",
    "get_prompt_format",
    "thinking_modes",
]


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A prompt ready for a completion API.

    Attributes:
        text: the whole prompt, ending with the cue for the model's reply.
        stop: the format's end-of-turn markers; generation stops at the first one.
    """

    text: str
    stop: tuple[str, ...]


def _effective_thinking(request: GenerationRequest, enable_thinking: bool | None) -> bool | None:
    """The request's thinking choice, else the model's configured default (None: unset)."""
    if request.thinking == "enabled":
        return True
    if request.thinking == "disabled":
        return False
    return enable_thinking


def _checked_turns(
    request: GenerationRequest, format_name: str, *, images: bool = False
) -> tuple[Turn, ...]:
    """The request's turns, refused where the prompt cannot carry them.

    ``images``: the backend hands the request's images to the model beside the text
    (the template only marks where each one goes), so image parts are allowed.
    """
    if not request.turns or request.turns[-1].role not in ("user", "tool"):
        raise PoolError(
            "invalid_request", "the conversation must end with a user message or a tool result"
        )
    # Dropping an image silently would answer a question the client never asked.
    if not images and any(turn.has_images for turn in request.turns):
        raise PoolError(
            "modality_unsupported", f"prompt_format {format_name} renders text only, not images"
        )
    return request.turns


def _uses_tools(request: GenerationRequest) -> bool:
    """Tools offered, or calls and results in the conversation."""
    return request.offers_tools or any(
        turn.role == "tool" or turn.tool_calls for turn in request.turns
    )


def _refuse_tools(request: GenerationRequest, format_name: str) -> None:
    """Refuse a request using tools on a format with no tool convention.

    The pool's intake refuses them first (the backend's capabilities say so); this keeps
    a format from ever dropping calls or results silently.
    """
    if _uses_tools(request):
        raise PoolError(
            "tools_unsupported",
            f"prompt_format {format_name} has no way to show tools to the model (use"
            " model_template with a chat template that renders them)",
            details={"param": "tools"},
        )


def _tool_object(tool: ToolSpec) -> dict[str, Any]:
    """A tool as chat templates receive it: OpenAI's function tool object (an empty
    description where it has none, as llama-server and ``model_template`` pass it)."""
    function = {
        "name": tool.name,
        "description": tool.description or "",
        "parameters": dict(tool.parameters),
    }
    return {"type": "function", "function": function}


def _call_object(call: ToolCall) -> dict[str, Any]:
    """``{"name", "arguments"}`` of a past call; arguments as an object where they parse."""
    return {"name": call.name, "arguments": _arguments(call.arguments)}


class PromptFormat(ABC):
    """How one family of models wants its conversation laid out.

    Attributes:
        name: the ``prompt_format`` value of a model definition.
        multi_turn: whether a multi-turn ``messages`` conversation can be rendered.
        supports_thinking_control: whether ``render`` honours thinking enabled/disabled.
        tool_family: the tool-call markup the format shows the model (and the model's
            reply is parsed in); None: the format has no tool convention and refuses
            tools. For ``model_template`` it is None: the markup depends on the model.
    """

    name: ClassVar[PromptFormatName]
    multi_turn: ClassVar[bool] = True
    supports_thinking_control: ClassVar[bool] = False
    tool_family: ClassVar[ToolCallFamily | None] = None

    @abstractmethod
    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        """Lay out ``request`` as one prompt string.

        Args:
            request: the conversation, instructions and per-request options.
            enable_thinking: the model definition's default for thinking, used when
                ``request.thinking`` is ``"default"``; None leaves the format's own default.

        Returns:
            The prompt text and the format's stop strings.

        Raises:
            PoolError: ``invalid_request`` (or a more precise code) for a request this
                format cannot render.
        """


class GenericFormat(PromptFormat):
    """A plain transcript for models without a chat format of their own.

    The instructions come first, then ``User:``/``Assistant:`` lines, and the prompt
    ends with ``Assistant:`` so the model writes the next reply.
    """

    name = "generic"

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        _refuse_tools(request, self.name)
        parts: list[str] = []
        if request.instructions:
            parts.append(f"{request.instructions.strip()}\n\n")
        for turn in _checked_turns(request, self.name):
            speaker = "User" if turn.role == "user" else "Assistant"
            parts.append(f"{speaker}: {turn.text.strip()}\n")
        parts.append("Assistant:")
        # A base model continues the transcript; the next "User:" line is where its
        # reply ends.
        return RenderedPrompt("".join(parts), ("\nUser:",))


class MistralFormat(PromptFormat):
    """Mistral's ``[INST] ... [/INST]`` turns.

    Mistral's instruct models have no system role, so the instructions open the
    first user turn. A past assistant reply is closed with ``</s>``, as Mistral's own
    template does.

    Tools follow Mistral's v3 tokenizer convention: the offered tools as a JSON list
    in ``[AVAILABLE_TOOLS] ...[/AVAILABLE_TOOLS]`` just before the last user turn, a
    past call as ``[TOOL_CALLS] [{"name", "arguments", "id"}]</s>`` and its result as
    ``[TOOL_RESULTS] {"content", "call_id"}[/TOOL_RESULTS]`` (a result that looks like
    JSON goes in as it is, as Mistral's template puts it; other text as a JSON string).
    Mistral's call ids are nine characters: a longer id is shown by its last nine (the
    random end of ``call_...`` ids), the same for the call and its result.
    """

    name = "mistral_template"
    tool_family = "mistral"

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        turns = _checked_turns(request, self.name)
        last_user = max((i for i, turn in enumerate(turns) if turn.role == "user"), default=-1)
        out: list[str] = []
        first_user = True
        for index, turn in enumerate(turns):
            text = turn.text.strip()
            if turn.role == "tool":
                content = turn.text if turn.text.lstrip()[:1] in ("{", "[") else _json(turn.text)
                call_id = _mistral_call_id(turn.tool_call_id or "")
                out.append(
                    f'[TOOL_RESULTS] {{"content": {content}, "call_id": "{call_id}"}}'
                    "[/TOOL_RESULTS]"
                )
                continue
            if turn.role == "assistant":
                if turn.tool_calls:
                    calls = [
                        {**_call_object(call), "id": _mistral_call_id(call.id)}
                        for call in turn.tool_calls
                    ]
                    out.append(f"{text}[TOOL_CALLS] {_json(calls)}</s>")
                else:
                    out.append(f"{text}</s>")
                continue
            if index == last_user and request.offers_tools:
                tools = _json([_tool_object(tool) for tool in request.tools])
                out.append(f"[AVAILABLE_TOOLS] {tools}[/AVAILABLE_TOOLS]")
            if first_user and request.instructions:
                text = f"{request.instructions.strip()}\n\n{text}"
            first_user = False
            out.append(f"[INST] {text} [/INST]")
        return RenderedPrompt("".join(out), ("</s>", "[INST]"))


def _mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's template wants it: nine characters, the id's last nine."""
    return call_id[-9:]


# Qwen3's own words around the offered tools (its chat template's system turn).
_QWEN3_TOOLS_OPEN = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_QWEN3_TOOLS_CLOSE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and"
    " arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class Qwen3Format(PromptFormat):
    """ChatML as Qwen3 (and SmolLM2) speak it, with Qwen3's switch for thinking.

    There is no system turn unless ``instructions`` is given: a small model answers
    better without an invented one (SmolLM2's embedded default derails it). Thinking
    disabled appends the empty think block that Qwen3's own template emits for
    ``enable_thinking=False``; enabled leaves the model free to open its own.

    Tools are laid out as Qwen3's template does (the Hermes convention): the offered
    tools as JSON lines in a ``<tools>`` block of the system turn (after the
    instructions), a past call as ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``
    after the assistant's text, and results as ``<tool_response>`` blocks in one user
    turn per run of consecutive results. The model answers in the same markup.
    """

    name = "qwen3_template"
    supports_thinking_control = True
    tool_family = "qwen3"

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        turns = _checked_turns(request, self.name)
        out: list[str] = []
        if request.offers_tools:
            system = f"{request.instructions}\n\n" if request.instructions else ""
            tools = "".join(f"\n{_json(_tool_object(tool))}" for tool in request.tools)
            out.append(
                f"<|im_start|>system\n{system}{_QWEN3_TOOLS_OPEN}{tools}{_QWEN3_TOOLS_CLOSE}"
                "<|im_end|>\n"
            )
        elif request.instructions:
            out.append(f"<|im_start|>system\n{request.instructions}<|im_end|>\n")
        for index, turn in enumerate(turns):
            if turn.role == "tool":
                if index == 0 or turns[index - 1].role != "tool":
                    out.append("<|im_start|>user")
                out.append(f"\n<tool_response>\n{turn.text}\n</tool_response>")
                if index == len(turns) - 1 or turns[index + 1].role != "tool":
                    out.append("<|im_end|>\n")
                continue
            text = turn.text
            if turn.role == "assistant" and "</think>" in text:
                # Qwen3 never shows the model its earlier reasoning, only its answers.
                text = text.rsplit("</think>", 1)[1].lstrip("\n")
            calls = "".join(
                ("\n" if number or text else "")
                + f"<tool_call>\n{_json(_call_object(call))}\n</tool_call>"
                for number, call in enumerate(turn.tool_calls)
            )
            out.append(f"<|im_start|>{turn.role}\n{text}{calls}<|im_end|>\n")
        out.append("<|im_start|>assistant\n")
        if _effective_thinking(request, enable_thinking) is False:
            out.append("<think>\n\n</think>\n\n")
        return RenderedPrompt("".join(out), ("<|im_end|>", "<|im_start|>"))


_GEMMA4_THOUGHT = re.compile(r"<\|channel>.*?<channel\|>", re.DOTALL)


class Gemma4Format(PromptFormat):
    """Gemma 4 turns: ``<|turn>role`` ... ``<turn|>``, with the reply role ``model``.

    Gemma 4 replaced Gemma 2/3's ``<start_of_turn>``/``<end_of_turn>`` with these
    control tokens and has a real system turn. Thinking follows Gemma 4's template:

    - on: the ``<|think|>`` token opens the system turn (added even without
      instructions); the model then reasons in a ``<|channel>thought`` block.
    - off: the reply cue is followed by an empty, already closed thought channel,
      which Gemma 4's template emits when thinking is off; it keeps a model that
      would open a channel on its own from reasoning.
    - unset (``"default"`` with no configured default): neither, the model's own
      default, which is not to think.

    Turn text is trimmed and earlier reasoning is dropped from past replies, as the
    template does. Gemma 4 writes tool calls in markup of its own that the pool does not
    parse: this format refuses tools (``model_template`` renders the model's own).
    """

    name = "gemma4_template"
    supports_thinking_control = True

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        _refuse_tools(request, self.name)
        turns = _checked_turns(request, self.name)
        thinking = _effective_thinking(request, enable_thinking)
        out: list[str] = []
        if thinking or request.instructions:
            think = "<|think|>\n" if thinking else ""
            system = request.instructions.strip() if request.instructions else ""
            out.append(f"<|turn>system\n{think}{system}<turn|>\n")
        for turn in turns:
            if turn.role == "assistant":
                text = _GEMMA4_THOUGHT.sub("", turn.text).strip()
                out.append(f"<|turn>model\n{text}<turn|>\n")
            else:
                out.append(f"<|turn>user\n{turn.text.strip()}<turn|>\n")
        out.append("<|turn>model\n")
        if thinking is False:
            out.append("<|channel>thought\n<channel|>")
        return RenderedPrompt("".join(out), ("<turn|>", "<|turn>"))


# English names of languages by ISO 639 code, as TranslateGemma's request spells
# them out; a regional code such as "pt-BR" is named by its base language.
_LANGUAGE_NAMES: dict[str, str] = {
    "af": "Afrikaans", "am": "Amharic", "ar": "Arabic", "az": "Azerbaijani",
    "be": "Belarusian", "bg": "Bulgarian", "bn": "Bengali", "bs": "Bosnian",
    "ca": "Catalan", "cs": "Czech", "cy": "Welsh", "da": "Danish", "de": "German",
    "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian", "eu": "Basque",
    "fa": "Persian", "fi": "Finnish", "fil": "Filipino", "fr": "French", "ga": "Irish",
    "gl": "Galician", "gu": "Gujarati", "ha": "Hausa", "he": "Hebrew", "hi": "Hindi",
    "hr": "Croatian", "hu": "Hungarian", "hy": "Armenian", "id": "Indonesian",
    "ig": "Igbo", "is": "Icelandic", "it": "Italian", "ja": "Japanese", "jv": "Javanese",
    "ka": "Georgian", "kk": "Kazakh", "km": "Khmer", "kn": "Kannada", "ko": "Korean",
    "ku": "Kurdish", "ky": "Kyrgyz", "lo": "Lao", "lt": "Lithuanian", "lv": "Latvian",
    "mk": "Macedonian", "ml": "Malayalam", "mn": "Mongolian", "mr": "Marathi",
    "ms": "Malay", "mt": "Maltese", "my": "Burmese", "nb": "Norwegian Bokmål",
    "ne": "Nepali", "nl": "Dutch", "nn": "Norwegian Nynorsk", "no": "Norwegian",
    "pa": "Punjabi", "pl": "Polish", "ps": "Pashto", "pt": "Portuguese",
    "ro": "Romanian", "ru": "Russian", "si": "Sinhala", "sk": "Slovak",
    "sl": "Slovenian", "so": "Somali", "sq": "Albanian", "sr": "Serbian",
    "sv": "Swedish", "sw": "Swahili", "ta": "Tamil", "te": "Telugu", "th": "Thai",
    "tl": "Tagalog", "tr": "Turkish", "uk": "Ukrainian", "ur": "Urdu", "uz": "Uzbek",
    "vi": "Vietnamese", "xh": "Xhosa", "yo": "Yoruba", "zh": "Chinese", "zu": "Zulu",
}  # fmt: skip
_LANGUAGE_CODE = re.compile(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})*")
_MIXED_SOURCE_CODES = ("", "auto", "mixed")
# The structured request needs a real source language even when the input mixes
# several; the prepended note tells the model to identify each segment's language
# itself, so this code only keeps the request in the shape the model was trained on.
_MIXED_SOURCE_FALLBACK = "en"
# The request TranslateGemma was fine-tuned on (the user turn of its chat template):
# the model translates best when it sees exactly this wording.
_TRANSLATEGEMMA_REQUEST = (
    "You are a professional {source} ({source_code}) to {target} ({target_code}) translator."
    " Your goal is to accurately convey the meaning and nuances of the original {source}"
    " text while adhering to {target} grammar, vocabulary, and cultural sensitivities.\n"
    "Produce only the {target} translation, without any additional explanations or"
    " commentary. Please translate the following {source} text into {target}:\n\n\n{text}"
)
_MIXED_SOURCE_NOTE = (
    "[The text below may mix several languages. Work out the language of each part"
    " on its own and translate every part into {target}.]\n\n"
)


def _language_code(value: str, field: str) -> str:
    """``value`` as a BCP-47-like code with hyphens; anything else would inject text."""
    if not _LANGUAGE_CODE.fullmatch(value):
        raise PoolError("invalid_request", f"{field} {value!r} is not a language code")
    return value.replace("_", "-")


def _language_name(code: str) -> str:
    # An unknown but well-formed code still names itself: the model knows many more
    # codes than this table, and refusing them would be worse than a plain code.
    return _LANGUAGE_NAMES.get(code.split("-")[0].lower(), code)


class TranslateGemmaFormat(PromptFormat):
    """TranslateGemma's structured single-turn request: source, target and text.

    The user turn carries the source and target language (name and code) and the
    text, worded exactly as the model was fine-tuned. With no source language, or
    ``"auto"``/``"mixed"``, the request keeps that shape with a fallback source code
    and puts a short note before the text asking the model to identify the
    language of each segment, so one input may mix several source languages.
    """

    name = "translategemma_template"
    multi_turn = False

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        _refuse_tools(request, self.name)
        turns = _checked_turns(request, self.name)
        if len(turns) != 1:
            raise PoolError(
                "multi_turn_unsupported", "translategemma_template takes one user message"
            )
        if request.instructions:
            # The structured request has no place for free instructions.
            raise PoolError("invalid_request", "translategemma_template takes no instructions")
        if not request.target_lang_code:
            raise PoolError("invalid_request", "translategemma_template needs target_lang_code")
        target_code = _language_code(request.target_lang_code, "target_lang_code")
        source = (request.source_lang_code or "").strip()
        mixed = source.lower() in _MIXED_SOURCE_CODES
        source_code = (
            _MIXED_SOURCE_FALLBACK if mixed else _language_code(source, "source_lang_code")
        )
        target = _language_name(target_code)
        text = turns[0].text.strip()
        if mixed:
            text = _MIXED_SOURCE_NOTE.format(target=target) + text
        user = _TRANSLATEGEMMA_REQUEST.format(
            source=_language_name(source_code),
            source_code=source_code,
            target=target,
            target_code=target_code,
            text=text,
        )
        # TranslateGemma is a Gemma 3 model: Gemma 3 turn markers, no system turn.
        prompt = f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"
        return RenderedPrompt(prompt, ("<end_of_turn>", "<start_of_turn>"))


@dataclass(frozen=True)
class ModelTemplate:
    """A chat template read from a model file: untrusted input.

    Attributes:
        source: the Jinja source.
        bos_token: the text of the model's BOS token, passed to the template.
        eos_token: the text of the model's EOS token, passed to the template and used
            as the stop string.
        add_bos: whether the model's tokenizer adds BOS itself; when it does, a BOS
            the template writes is dropped so the prompt does not start with two.
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, str], token_text: Callable[[int], str] | None = None
    ) -> ModelTemplate | None:
        """The chat template of a GGUF file, from its metadata.

        Args:
            metadata: the GGUF key/value metadata (as llama-cpp-python's
                ``Llama.metadata`` gives it, every value a string).
            token_text: the text of a token id; without it BOS/EOS stay empty.

        Returns:
            The template, or None when the file has no ``tokenizer.chat_template``.
        """
        source = metadata.get("tokenizer.chat_template")
        if not source:
            return None

        def token(key: str) -> str:
            raw = metadata.get(key)
            if raw is None or token_text is None:
                return ""
            try:
                return token_text(int(raw))
            except (ValueError, LookupError):
                return ""

        flag = metadata.get("tokenizer.ggml.add_bos_token")
        if flag is None:
            # llama.cpp's default when the file does not say: SentencePiece
            # vocabularies add BOS, byte-level BPE ones do not.
            add_bos = metadata.get("tokenizer.ggml.model") == "llama"
        else:
            add_bos = str(flag).lower() == "true"
        return cls(
            source,
            token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"),
            add_bos,
        )


class ModelTemplateFormat(PromptFormat):
    """Renders the chat template shipped inside the model file, sandboxed.

    The template sees ``messages`` (``{"role", "content"}`` dicts, the instructions
    as a leading ``system`` message), ``add_generation_prompt=True``, ``bos_token``,
    ``eos_token`` and, where thinking is set, ``enable_thinking``. A template that
    does not compile, fails, reaches for Python internals or goes past the sandbox's
    limits (1 MB of prompt among them) is refused with ``invalid_request``.

    ``supports_thinking_control`` is true only for templates that read
    ``enable_thinking``; constructing this class picks the matching subclass.

    Args:
        template: the template and its special tokens.

    Raises:
        PoolError: ``invalid_request`` when the template does not compile.
    """

    name = "model_template"

    def __new__(cls, template: ModelTemplate, *, images: bool = False) -> ModelTemplateFormat:
        if cls is ModelTemplateFormat and "enable_thinking" in template.source:
            return super().__new__(_ThinkingModelTemplateFormat)
        return super().__new__(cls)

    def __init__(self, template: ModelTemplate, *, images: bool = False) -> None:
        self._template = template
        self._images = images
        try:
            self._compiled = SandboxedTemplate(template.source)
        except Exception as exc:  # any failure of untrusted input
            raise PoolError(
                "invalid_request",
                f"the model's chat template does not compile: {type(exc).__name__}: {exc}",
            ) from exc

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        messages: list[dict[str, Any]] = []
        if request.instructions:
            messages.append({"role": "system", "content": request.instructions})
        turns = _checked_turns(request, self.name, images=self._images)
        messages += [template_message(turn, images=self._images) for turn in turns]
        variables: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": True,
            "bos_token": self._template.bos_token,
            "eos_token": self._template.eos_token,
        }
        if request.offers_tools:
            if not self.renders_tools:
                raise PoolError(
                    "tools_unsupported",
                    "the model's chat template does not render tools (configure a"
                    " tool-capable chat template for it)",
                    details={"param": "tools"},
                )
            # As transformers' apply_chat_template passes them: OpenAI's tool objects.
            variables["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description or "",
                        "parameters": dict(tool.parameters),
                    },
                }
                for tool in request.tools
            ]
        thinking = _effective_thinking(request, enable_thinking)
        if thinking is not None:
            variables["enable_thinking"] = thinking
        text = self._render(variables)
        bos = self._template.bos_token
        if self._template.add_bos and bos and text.startswith(bos):
            text = text[len(bos) :]
        eos = self._template.eos_token
        return RenderedPrompt(text, (eos,) if eos else ())

    @property
    def renders_tools(self) -> bool:
        """Whether the template reads ``tools`` (so offered tools reach the model)."""
        return "tools" in self._template.source

    def _render(self, variables: dict[str, Any]) -> str:
        try:
            return self._compiled.render(variables)
        except RecursionError as exc:
            raise PoolError("invalid_request", "the model's chat template recursed") from exc
        except TemplateLimitError as exc:
            raise PoolError("invalid_request", f"the model's chat template stopped: {exc}") from exc
        except Exception as exc:  # SecurityError, TemplateError, template bugs
            raise PoolError(
                "invalid_request",
                f"the model's chat template failed: {type(exc).__name__}: {exc}",
            ) from exc


def template_message(turn: Turn, *, images: bool = False) -> dict[str, Any]:
    """One turn as chat templates read it (transformers' message dicts).

    Tool calls carry their arguments as a mapping where they parse (templates write
    them with ``tojson``); a tool result carries the id of its call. With ``images``, a
    turn that has images keeps its parts in order as a content list
    (``{"type": "image"}``, ``{"type": "text", "text": ...}``), as vision models'
    templates read it to place each image's marker; the image data travels apart.
    """
    content: str | list[dict[str, str]] = turn.text
    if images and turn.has_images:
        content = [
            {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
            for part in turn.parts
        ]
    message: dict[str, Any] = {"role": turn.role, "content": content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in turn.tool_calls
        ]
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    return message


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _json(value: Any) -> str:
    """JSON as chat templates' ``tojson`` writes it (transformers: ``", "``/``": "``)."""
    return json.dumps(value, ensure_ascii=False)


class _ThinkingModelTemplateFormat(ModelTemplateFormat):
    """A model template that reads ``enable_thinking``, so thinking can be switched."""

    supports_thinking_control = True


_FORMATS: dict[str, type[PromptFormat]] = {
    cls.name: cls
    for cls in (GenericFormat, MistralFormat, Qwen3Format, Gemma4Format, TranslateGemmaFormat)
}
# The settings' list of names; each class above declares its name from it.
PROMPT_FORMAT_NAMES: tuple[PromptFormatName, ...] = get_args(PromptFormatName)


def get_prompt_format(
    name: str, *, model_template: ModelTemplate | None = None, images: bool = False
) -> PromptFormat:
    """The prompt format called ``name``.

    Args:
        name: one of :data:`PROMPT_FORMAT_NAMES`.
        model_template: the model file's chat template; required for ``model_template``.
        images: the backend passes images to the model itself; ``model_template`` then
            renders image parts as the template's markers (the other formats refuse
            images either way).

    Returns:
        A format instance, ready to render.

    Raises:
        ValueError: an unknown name, or ``model_template`` without a template.
        PoolError: ``invalid_request`` when the model's template does not compile.
    """
    if name == ModelTemplateFormat.name:
        if model_template is None:
            raise ValueError(
                "prompt_format model_template needs the chat template of the model file"
            )
        return ModelTemplateFormat(model_template, images=images)
    format_class = _FORMATS.get(name)
    if format_class is None:
        raise ValueError(
            f"unknown prompt_format {name!r} (known: {', '.join(PROMPT_FORMAT_NAMES)})"
        )
    return format_class()


def format_traits(name: str) -> tuple[bool, bool]:
    """``(multi_turn, supports_thinking_control)`` of a format, without building it.

    For ``model_template`` thinking support depends on the template, which is not
    at hand here, so it is reported as unsupported.

    Raises:
        ValueError: an unknown name.
    """
    if name == ModelTemplateFormat.name:
        return ModelTemplateFormat.multi_turn, False
    format_class = _FORMATS.get(name)
    if format_class is None:
        raise ValueError(f"unknown prompt_format {name!r}")
    return format_class.multi_turn, format_class.supports_thinking_control


def format_tool_family(name: str) -> ToolCallFamily | None:
    """The tool-call markup a built-in format shows the model; None for a format with
    no tool convention and for ``model_template`` (whose markup is the model's).

    Raises:
        ValueError: an unknown name.
    """
    if name == ModelTemplateFormat.name:
        return None
    format_class = _FORMATS.get(name)
    if format_class is None:
        raise ValueError(f"unknown prompt_format {name!r}")
    return format_class.tool_family


def format_renders_tools(name: str) -> bool:
    """Whether a model rendered with format ``name`` can be offered tools.

    ``model_template`` can (whether the model's template reads ``tools`` is checked
    when a request is rendered); a built-in format can where it has a tool convention.

    Raises:
        ValueError: an unknown name.
    """
    return name == ModelTemplateFormat.name or format_tool_family(name) is not None


def thinking_modes(name: str) -> tuple[ThinkingMode, ...]:
    """The request ``thinking`` values a model rendered with format ``name`` accepts.

    The one place that decides thinking support for every backend that renders its
    own prompts: the format's :func:`format_traits`.

    Raises:
        ValueError: an unknown name.
    """
    _, thinking_control = format_traits(name)
    return ALL_THINKING_MODES if thinking_control else ("default",)
