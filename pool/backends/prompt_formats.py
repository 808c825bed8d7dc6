"""Prompt formats: how a conversation becomes one prompt string for completion runtimes.

Each format is a small class with the same shape: whether it takes multi-turn
conversations, whether it can switch thinking per request, and ``render``. The
``model_template`` format runs the chat template shipped inside a model file; that
template is untrusted input, so it runs in Jinja's immutable sandbox with a bounded
output size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pool.backends._protocol import GenerationRequest
from pool.errors import PoolError

# Output bound of a model-supplied template: a prompt larger than this is a template
# bug or an attack, not a conversation.
MAX_TEMPLATE_OUTPUT = 1_000_000


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    text: str
    stop: tuple[str, ...]


def _thinking_on(request: GenerationRequest, enable_thinking: bool | None) -> bool | None:
    """The request's thinking choice, else the model's ``enable_thinking`` (None: unset)."""
    if request.thinking == "enabled":
        return True
    if request.thinking == "disabled":
        return False
    return enable_thinking


class PromptFormat:
    name: ClassVar[str]
    multi_turn: ClassVar[bool] = True
    supports_thinking_control: ClassVar[bool] = False

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        raise NotImplementedError


class GenericFormat(PromptFormat):
    """A plain transcript for models without a chat format of their own."""

    name = "generic"

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        parts = []
        if request.instructions:
            parts.append(f"{request.instructions.strip()}\n")
        for turn in request.turns:
            speaker = "User" if turn.role == "user" else "Assistant"
            parts.append(f"{speaker}: {turn.text}\n")
        parts.append("Assistant:")
        return RenderedPrompt("".join(parts), ("\nUser:",))


class MistralFormat(PromptFormat):
    """``[INST] ... [/INST]``; the system prompt is folded into the first user turn."""

    name = "mistral_template"

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        out = ["<s>"]
        first_user = True
        for turn in request.turns:
            if turn.role == "user":
                text = turn.text
                if first_user and request.instructions:
                    text = f"{request.instructions.strip()}\n\n{text}"
                first_user = False
                out.append(f"[INST] {text} [/INST]")
            else:
                out.append(f" {turn.text}</s>")
        return RenderedPrompt("".join(out), ("</s>", "[INST]"))


class Qwen3Format(PromptFormat):
    """ChatML, as Qwen3 and SmolLM2 speak it, with Qwen3's switch for thinking.

    No system turn unless ``instructions`` is given: small models answer better
    without an invented one. Thinking disabled appends the empty think block that
    Qwen3's own template emits for ``enable_thinking=False``.
    """

    name = "qwen3_template"
    supports_thinking_control = True

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        out = []
        if request.instructions:
            out.append(f"<|im_start|>system\n{request.instructions}<|im_end|>\n")
        for turn in request.turns:
            out.append(f"<|im_start|>{turn.role}\n{turn.text}<|im_end|>\n")
        out.append("<|im_start|>assistant\n")
        if _thinking_on(request, enable_thinking) is False:
            out.append("<think>\n\n</think>\n\n")
        return RenderedPrompt("".join(out), ("<|im_end|>", "<|im_start|>"))


class Gemma4Format(PromptFormat):
    """Gemma turns (``<start_of_turn>user`` / ``model``).

    Gemma has no system role: instructions open the first user turn. Thinking is
    switched on by the ``<|think|>`` control token at the start of that text, the way
    Gemma 4's template does it; without it the model answers directly.
    """

    name = "gemma4_template"
    supports_thinking_control = True

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        out = ["<bos>"]
        preamble = request.instructions.strip() if request.instructions else ""
        if _thinking_on(request, enable_thinking):
            preamble = f"<|think|>{preamble}"
        first_user = True
        for turn in request.turns:
            role = "user" if turn.role == "user" else "model"
            text = turn.text
            if first_user and role == "user" and preamble:
                text = f"{preamble}\n\n{text}"
            if role == "user":
                first_user = False
            out.append(f"<start_of_turn>{role}\n{text}<end_of_turn>\n")
        out.append("<start_of_turn>model\n")
        return RenderedPrompt("".join(out), ("<end_of_turn>", "<start_of_turn>"))


_LANGUAGES = {
    "ar": "Arabic", "bg": "Bulgarian", "cs": "Czech", "da": "Danish", "de": "German",
    "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian", "fi": "Finnish",
    "fr": "French", "he": "Hebrew", "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian",
    "it": "Italian", "ja": "Japanese", "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian",
    "nl": "Dutch", "no": "Norwegian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sv": "Swedish", "th": "Thai",
    "tr": "Turkish", "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese",
}  # fmt: skip
_MIXED_SOURCE = (None, "", "auto", "mixed")
# A valid code for the structured request when the source is mixed; the instruction
# below tells the model to work out each segment's language itself.
_MIXED_FALLBACK = "en"


def _language(code: str) -> str:
    base = code.replace("_", "-").split("-")[0].lower()
    return _LANGUAGES.get(base, code)


class TranslateGemmaFormat(PromptFormat):
    """TranslateGemma's structured single-turn request: source, target, text.

    With no source language (or ``auto``/``mixed``) the request keeps the structured
    shape with a fallback source code and asks the model to detect the language of
    each segment, so one input may mix several source languages.
    """

    name = "translategemma_template"
    multi_turn = False

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        if not request.target_lang_code:
            raise PoolError("invalid_request", "translategemma_template needs target_lang_code")
        if len(request.turns) != 1:
            raise PoolError("invalid_request", "translategemma_template is single-turn")
        target_code = request.target_lang_code
        target = _language(target_code)
        mixed = request.source_lang_code in _MIXED_SOURCE or str(
            request.source_lang_code
        ).lower() in ("auto", "mixed")
        source_code = _MIXED_FALLBACK if mixed else str(request.source_lang_code)
        source = _language(source_code)
        text = request.turns[0].text
        lead = (
            f"You are a professional {source} ({source_code}) to {target} ({target_code})"
            f" translator. Convey the meaning and nuance of the original faithfully in"
            f" natural {target}. Produce only the {target} translation, with no"
            f" explanations or commentary. Translate the following {source} text into"
            f" {target}:"
        )
        if mixed:
            lead = (
                "The text may mix several source languages. Detect the language of each"
                f" segment yourself and translate every segment into {target}.\n" + lead
            )
        prompt = (
            f"<bos><start_of_turn>user\n{lead}\n\n\n{text}<end_of_turn>\n<start_of_turn>model\n"
        )
        return RenderedPrompt(prompt, ("<end_of_turn>", "<start_of_turn>"))


@dataclass(frozen=True)
class ModelTemplate:
    """A chat template read from a model file."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, str], token_text: Callable[[int], str] | None = None
    ) -> ModelTemplate | None:
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

        return cls(
            source,
            token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"),
        )


class ModelTemplateFormat(PromptFormat):
    """Renders the model's own chat template, sandboxed."""

    name = "model_template"

    def __init__(self, template: ModelTemplate) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        self._template_error = TemplateError
        self._model_template = template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._compiled = env.from_string(template.source)
        except TemplateError as exc:
            raise PoolError(
                "invalid_request", f"the model's chat template is invalid: {exc}"
            ) from exc

    @property
    def supports_thinking(self) -> bool:
        return "enable_thinking" in self._model_template.source

    def render(
        self, request: GenerationRequest, *, enable_thinking: bool | None = None
    ) -> RenderedPrompt:
        messages: list[dict[str, Any]] = []
        if request.instructions:
            messages.append({"role": "system", "content": request.instructions})
        messages += [{"role": t.role, "content": t.text} for t in request.turns]
        variables: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": True,
            "bos_token": self._model_template.bos_token,
            "eos_token": self._model_template.eos_token,
        }
        thinking = _thinking_on(request, enable_thinking)
        if thinking is not None:
            variables["enable_thinking"] = thinking
        try:
            pieces = []
            size = 0
            for chunk in self._compiled.generate(**variables):
                size += len(chunk)
                if size > MAX_TEMPLATE_OUTPUT:
                    raise PoolError(
                        "invalid_request", "the model's chat template output is too large"
                    )
                pieces.append(chunk)
        except PoolError:
            raise
        except Exception as exc:  # SecurityError, TemplateError, TypeError from the template
            raise PoolError(
                "invalid_request", f"the model's chat template failed: {type(exc).__name__}: {exc}"
            ) from exc
        stop = tuple(t for t in (self._model_template.eos_token,) if t)
        return RenderedPrompt("".join(pieces), stop)


_FORMATS: dict[str, type[PromptFormat]] = {
    cls.name: cls
    for cls in (GenericFormat, MistralFormat, Qwen3Format, Gemma4Format, TranslateGemmaFormat)
}
PROMPT_FORMAT_NAMES: tuple[str, ...] = (*_FORMATS, "model_template")


def get_prompt_format(name: str, *, model_template: ModelTemplate | None = None) -> PromptFormat:
    """The prompt format called ``name``.

    Raises:
        ValueError: an unknown name, or ``model_template`` without a template.
    """
    if name == "model_template":
        if model_template is None:
            raise ValueError(
                "prompt_format model_template needs a chat template from the model file"
            )
        return ModelTemplateFormat(model_template)
    try:
        return _FORMATS[name]()
    except KeyError:
        raise ValueError(
            f"unknown prompt_format {name!r} (known: {', '.join(PROMPT_FORMAT_NAMES)})"
        ) from None


def format_traits(name: str) -> tuple[bool, bool]:
    """(multi_turn, supports_thinking_control) of a format, without a template at hand."""
    if name == "model_template":
        return True, False
    cls = _FORMATS[name]
    return cls.multi_turn, cls.supports_thinking_control
