"""The pool's built-in prompt formats as Jinja chat templates, for ``llama_server``.

llama-server renders prompts itself (``--jinja``), from the model's own template or
one it is given. A GGUF's own template may not be the layout its ``prompt_format``
names (SmolLM2's adds a system prompt and has no tools), and llama-server's built-in
template names are no help: with ``--jinja`` it takes ``--chat-template NAME`` as
Jinja source (apart from ``chatml``, whose built-in template drops tools and past
calls), so ``mistral-v7`` or ``gemma`` would be the whole prompt. So a model whose
``prompt_format`` is one of these gets the pool's template as ``--chat-template-file``:
the same layout the format renders in-process (:mod:`pool.backends.prompt_formats`),
tools, past calls and results included, so the server shows them to the model and
parses the reply's calls in the family's markup.

The templates read what llama-server passes: ``messages`` (a leading ``system``
message holds the instructions), ``tools``, ``add_generation_prompt`` and
``enable_thinking`` (from ``chat_template_kwargs``). They stay within the Jinja that
both llama.cpp's engine and Jinja2 understand.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

__all__ = ["FORMAT_TEMPLATES", "format_template_file"]

# Qwen3Format: Qwen3's tool block and markup; thinking off closes an empty think block.
_QWEN3 = r"""{%- set ns = namespace(system='') -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set ns.system = messages[0].content -%}
{%- endif -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if ns.system -%}{{- ns.system + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and' -}}
{{- ' arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif ns.system -%}
{{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
{{- '<|im_start|>user' -}}
{%- endif -%}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- else -%}
{%- set content = message.content or '' -%}
{%- if message.role == 'assistant' and '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- '<|im_start|>' + message.role + '\n' + content -}}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- if not loop.first or content -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' -}}
{%- if call.function.arguments is string -%}
{{- call.function.arguments -}}
{%- else -%}
{{- call.function.arguments | tojson -}}
{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- endif -%}
{%- endif -%}
"""

# MistralFormat: [INST] turns (the instructions open the first), Mistral v3's tool markup.
_MISTRAL = r"""{%- set ns = namespace(system='', last_user=-1, first=true) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set ns.system = messages[0].content -%}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- elif message.role == 'tool' -%}
{%- set content = message.content or '' -%}
{{- '[TOOL_RESULTS] {"content": ' -}}
{%- if content.lstrip().startswith('{') or content.lstrip().startswith('[') -%}
{{- content -}}
{%- else -%}
{{- content | tojson -}}
{%- endif -%}
{{- ', "call_id": "' + (message.tool_call_id or '')[-9:] + '"}[/TOOL_RESULTS]' -}}
{%- elif message.role == 'assistant' -%}
{{- (message.content or '').strip() -}}
{%- if message.tool_calls -%}
{{- '[TOOL_CALLS] [' -}}
{%- for call in message.tool_calls -%}
{%- if not loop.first -%}{{- ', ' -}}{%- endif -%}
{{- '{"name": "' + call.function.name + '", "arguments": ' -}}
{%- if call.function.arguments is string -%}
{{- call.function.arguments -}}
{%- else -%}
{{- call.function.arguments | tojson -}}
{%- endif -%}
{{- ', "id": "' + (call.id or '')[-9:] + '"}' -}}
{%- endfor -%}
{{- ']' -}}
{%- endif -%}
{{- '</s>' -}}
{%- else -%}
{%- if loop.index0 == ns.last_user and tools -%}
{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}
{%- endif -%}
{%- set text = (message.content or '').strip() -%}
{%- if ns.first and ns.system -%}
{%- set text = ns.system.strip() + '\n\n' + text -%}
{%- endif -%}
{%- set ns.first = false -%}
{{- '[INST] ' + text + ' [/INST]' -}}
{%- endif -%}
{%- endfor -%}
"""

# Gemma4Format: <|turn> turns, the reply role `model`, the thinking switch; no tools.
_GEMMA4 = r"""{%- set ns = namespace(system='', text='') -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set ns.system = messages[0].content -%}
{%- endif -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- if thinking or ns.system -%}
{{- '<|turn>system\n' -}}
{%- if thinking -%}{{- '<|think|>\n' -}}{%- endif -%}
{{- ns.system.strip() + '<turn|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- elif message.role == 'assistant' -%}
{%- set parts = (message.content or '').split('<|channel>') -%}
{%- set ns.text = parts[0] -%}
{%- for part in parts[1:] -%}
{%- if '<channel|>' in part -%}
{%- set ns.text = ns.text + (part.split('<channel|>')[1:] | join('<channel|>')) -%}
{%- else -%}
{%- set ns.text = ns.text + '<|channel>' + part -%}
{%- endif -%}
{%- endfor -%}
{{- '<|turn>model\n' + ns.text.strip() + '<turn|>\n' -}}
{%- else -%}
{{- '<|turn>user\n' + (message.content or '').strip() + '<turn|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|turn>model\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<|channel>thought\n<channel|>' -}}
{%- endif -%}
{%- endif -%}
"""

FORMAT_TEMPLATES: dict[str, str] = {
    "qwen3_template": _QWEN3,
    "mistral_template": _MISTRAL,
    "gemma4_template": _GEMMA4,
}


def format_template_file(name: str) -> str:
    """A file holding the Jinja template of built-in format ``name``.

    The file is named by its content's hash in a private folder, written once (atomic
    rename), so replicas and restarts share it and a pool upgrade never reads a stale one.

    Raises:
        KeyError: a format with no template here.
    """
    source = FORMAT_TEMPLATES[name]
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"llm-pool-templates-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{name}-{digest}.jinja"
    if not path.is_file():
        partial = folder / f".{path.name}.{os.getpid()}"
        partial.write_text(source, encoding="utf-8")
        partial.replace(path)
    return str(path)
