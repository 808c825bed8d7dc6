"""The fake vLLM (``fake_vllm.py``) held to vLLM's source, read with ``ast``.

The sleep-mode tests (tests/actors/test_vllm_sleep.py) run the pool against the fake, so
the fake must say what vLLM says where the backend touches it:

- ``AsyncLLM.sleep``, ``wake_up`` and ``is_sleeping``: coroutines, with the same
  parameters (names, kinds, defaults) and return annotation;
- every other method of ``AsyncLLM`` the fake plays (``from_vllm_config``,
  ``shutdown``...): coroutine or not alike, the same parameter names and kinds;
- ``enable_sleep_mode``: a field of the engine arguments (``AsyncEngineArgs`` is an
  ``EngineArgs``) with the fake's default, handed to ``ModelConfig`` (whose
  ``enable_sleep_mode`` the fake's config carries), which has the field too.

Read as source, not imported: importing vLLM takes torch and seconds, and the source of
an unpacked wheel is enough. :func:`problems` returns what does not hold, one line each;
``python -m tests.backends.vllm_contract DIR`` prints them for a ``vllm`` package folder.
"""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.backends import fake_vllm

ASYNC_LLM_FILE = "v1/engine/async_llm.py"
ENGINE_ARGS_FILE = "engine/arg_utils.py"
MODEL_CONFIG_FILE = "config/model.py"
# Compared whole: what the pool's sleep mode calls (pool/backends/_vllm_engine.py).
SLEEP_METHODS = ("sleep", "wake_up", "is_sleeping")
# The fake's own constructor is its business: vLLM's takes the engine's parts.
_NOT_COMPARED = {"__init__"}


@dataclass(frozen=True)
class Signature:
    """What a call site sees of a method; its first parameter (self, cls) left out."""

    is_async: bool
    # (name, kind, default as source text or None)
    parameters: tuple[tuple[str, str, str | None], ...]
    returns: str | None

    def shape(self) -> tuple[bool, tuple[tuple[str, str], ...]]:
        return self.is_async, tuple((name, kind) for name, kind, _ in self.parameters)


def _source_signature(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Signature:
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    kinds = ["POSITIONAL_ONLY"] * len(args.posonlyargs) + ["POSITIONAL_OR_KEYWORD"] * len(args.args)
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += list(args.defaults)
    parameters = [
        (arg.arg, kind, ast.unparse(default) if default is not None else None)
        for arg, kind, default in zip(positional, kinds, defaults, strict=True)
    ]
    is_static = any(ast.unparse(d) == "staticmethod" for d in function.decorator_list)
    if not is_static:
        parameters = parameters[1:]
    if args.vararg is not None:
        parameters.append((args.vararg.arg, "VAR_POSITIONAL", None))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        parameters.append((arg.arg, "KEYWORD_ONLY", ast.unparse(default) if default else None))
    if args.kwarg is not None:
        parameters.append((args.kwarg.arg, "VAR_KEYWORD", None))
    returns = ast.unparse(function.returns) if function.returns is not None else None
    return Signature(
        isinstance(function, ast.AsyncFunctionDef), tuple(parameters), _unquoted(returns)
    )


def _unquoted(annotation: str | None) -> str | None:
    """``"AsyncLLM"`` and ``AsyncLLM`` are one annotation."""
    if annotation and annotation[0] == annotation[-1] and annotation[0] in "'\"":
        return annotation[1:-1]
    return annotation


def fake_signature(cls: type, name: str) -> Signature:
    """The fake's method ``name`` as :class:`Signature` (its annotations are source text:
    fake_vllm.py has ``from __future__ import annotations``)."""
    attribute = vars(cls)[name]
    function = (
        attribute.__func__ if isinstance(attribute, classmethod | staticmethod) else attribute
    )
    parameters = list(inspect.signature(function).parameters.values())
    if not isinstance(attribute, staticmethod):
        parameters = parameters[1:]
    described = tuple(
        (p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default))
        for p in parameters
    )
    returns = inspect.signature(function).return_annotation
    text = None if returns is inspect.Signature.empty else str(returns)
    return Signature(inspect.iscoroutinefunction(function), described, _unquoted(text))


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {
        item.name: item
        for item in cls.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _fields(cls: ast.ClassDef) -> dict[str, ast.AnnAssign]:
    return {
        item.target.id: item
        for item in cls.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }


def _field_default(
    field: ast.AnnAssign, classes: dict[str, ast.ClassDef]
) -> tuple[str | None, str]:
    """(default as source text, where it was found); a default that names another
    class's field (``ModelConfig.enable_sleep_mode``) is that field's default."""
    value = field.value
    if (
        isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and value.value.id in classes
    ):
        owner = _fields(classes[value.value.id]).get(value.attr)
        if owner is not None and owner.value is not None:
            return ast.unparse(owner.value), f"{value.value.id}.{value.attr}"
    return (ast.unparse(value) if value is not None else None), "the field"


def _compare(where: str, ours: Signature, theirs: Signature, *, whole: bool) -> list[str]:
    found: list[str] = []
    if ours.is_async != theirs.is_async:
        kind = "a coroutine" if theirs.is_async else "a plain method"
        found.append(f"{where}: vLLM's is {kind}, the fake's is not")
    if [(n, k) for n, k, _ in ours.parameters] != [(n, k) for n, k, _ in theirs.parameters]:
        found.append(f"{where}: parameters {_listed(theirs)} in vLLM, {_listed(ours)} in the fake")
    elif whole:
        for (name, _, mine), (_, _, real) in zip(ours.parameters, theirs.parameters, strict=True):
            if mine != real:
                found.append(f"{where}: {name} defaults to {real} in vLLM, {mine} in the fake")
    if whole and ours.returns != theirs.returns:
        found.append(f"{where}: returns {theirs.returns} in vLLM, {ours.returns} in the fake")
    return found


def _listed(signature: Signature) -> str:
    return "(" + ", ".join(f"{n} {k.lower()}" for n, k, _ in signature.parameters) + ")"


def problems(root: Path) -> list[str]:
    """What the fake says of vLLM that the ``vllm`` package source at ``root`` does not."""
    found: list[str] = []
    files = {name: root / name for name in (ASYNC_LLM_FILE, ENGINE_ARGS_FILE, MODEL_CONFIG_FILE)}
    for name, path in files.items():
        if not path.is_file():
            found.append(f"{name} is missing from {root}")
    if found:
        return found

    async_llm = _classes(files[ASYNC_LLM_FILE]).get("AsyncLLM")
    if async_llm is None:
        return [f"no class AsyncLLM in {ASYNC_LLM_FILE}"]
    real_methods = _methods(async_llm)
    fake_methods = [
        name
        for name, value in vars(fake_vllm.FakeAsyncLLM).items()
        if callable(value) or isinstance(value, classmethod | staticmethod)
    ]
    for name in SLEEP_METHODS:
        if name not in fake_methods:
            found.append(f"AsyncLLM.{name}: the fake lacks it")
    for name in fake_methods:
        if name in _NOT_COMPARED:
            continue
        if name not in real_methods:
            found.append(f"AsyncLLM.{name}: not in vLLM's {ASYNC_LLM_FILE}")
            continue
        found += _compare(
            f"AsyncLLM.{name}",
            fake_signature(fake_vllm.FakeAsyncLLM, name),
            _source_signature(real_methods[name]),
            whole=name in SLEEP_METHODS,
        )
    found += _sleep_mode_argument(files[ENGINE_ARGS_FILE], files[MODEL_CONFIG_FILE])
    return found


# What the pool's `vllm_serve` resume sends (pool/backends/_managed.py, _resume): the
# request class vLLM's server reads each body into.
TOKENIZE_FILE = "entrypoints/serve/tokenize/protocol.py"
COMPLETION_FILE = "entrypoints/openai/completion/protocol.py"
REQUEST_CLASSES = {
    "TokenizeChatRequest": TOKENIZE_FILE,
    "TokenizeCompletionRequest": TOKENIZE_FILE,
    "CompletionRequest": COMPLETION_FILE,
}


def request_field_problems(root: Path, sent: dict[str, set[str]]) -> list[str]:
    """The fields of each body the pool sends (by vLLM's request class) that the class
    in the source at ``root`` does not declare. vLLM's request models allow extra
    fields and ignore them with a warning, so a misspelt field would go unnoticed."""
    found: list[str] = []
    for name, fields in sent.items():
        path = root / REQUEST_CLASSES[name]
        if not path.is_file():
            found.append(f"{REQUEST_CLASSES[name]} is missing from {root}")
            continue
        cls = _classes(path).get(name)
        if cls is None:
            found.append(f"no class {name} in {REQUEST_CLASSES[name]}")
            continue
        declared = set(_fields(cls))
        for field in sorted(fields - declared):
            found.append(f"{name}.{field}: the pool sends it; vLLM does not declare it")
    return found


def _sleep_mode_argument(engine_args_file: Path, model_config_file: Path) -> list[str]:
    """``enable_sleep_mode`` from the engine arguments to ``ModelConfig``."""
    found: list[str] = []
    classes = {**_classes(model_config_file), **_classes(engine_args_file)}
    engine_args, async_args = classes.get("EngineArgs"), classes.get("AsyncEngineArgs")
    model_config = classes.get("ModelConfig")
    if engine_args is None or async_args is None or model_config is None:
        missing = [n for n in ("EngineArgs", "AsyncEngineArgs", "ModelConfig") if n not in classes]
        return [f"no class {', '.join(missing)} in vLLM's source"]
    if "EngineArgs" not in [ast.unparse(base) for base in async_args.bases]:
        found.append("AsyncEngineArgs: not an EngineArgs")
    parameter = inspect.signature(fake_vllm.EngineArgs).parameters.get("enable_sleep_mode")
    assert parameter is not None, "the fake's EngineArgs takes enable_sleep_mode"
    ours = repr(parameter.default)
    field = _fields(async_args).get("enable_sleep_mode") or _fields(engine_args).get(
        "enable_sleep_mode"
    )
    if field is None:
        found.append("EngineArgs.enable_sleep_mode: no such field")
    else:
        if ast.unparse(field.annotation) != "bool":
            found.append(f"EngineArgs.enable_sleep_mode: a {ast.unparse(field.annotation)}")
        default, source = _field_default(field, classes)
        if default != ours:
            found.append(
                f"EngineArgs.enable_sleep_mode defaults to {default} ({source}) in vLLM,"
                f" {ours} in the fake"
            )
    if "enable_sleep_mode" not in _fields(model_config):
        found.append("ModelConfig.enable_sleep_mode: no such field")
    handed = any(
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "ModelConfig"
        and any(
            k.arg == "enable_sleep_mode" and ast.unparse(k.value) == "self.enable_sleep_mode"
            for k in node.keywords
        )
        for node in ast.walk(engine_args)
    )
    if not handed:
        found.append("EngineArgs: no ModelConfig(..., enable_sleep_mode=self.enable_sleep_mode)")
    return found


def main(argv: list[str]) -> int:
    found = problems(Path(argv[0]))
    print("\n".join(found) or "no problems")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
