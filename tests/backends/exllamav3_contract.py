"""What the exllamav3 backend uses of the exllamav3 package, checked on its source with ``ast``.

Importing exllamav3 compiles its CUDA extension, so nothing here imports it: both sides
are read as source. The uses come from the backend's own source
(``pool/backends/exllamav3.py``), so a call or a result field added there is checked
without a list to keep in step:

- every call into exllamav3 (``lib.X(...)``, ``lib.X.m(...)``, and methods on the
  generator, model and tokenizer): the class and method exist, take that many
  positional arguments and each keyword by name (a keyword that only a ``**kwargs``
  would swallow does not count; one that ``**kwargs`` forwards to another method of the
  class, as ``Model.load`` does to ``Model.load_gen``, is checked there). The keys of a
  ``**mapping`` (``**plan.load_kwargs``, ``**layer``) are read from the backend's
  assignments to that name;
- every attribute read with ``getattr(tokenizer|config, "name")`` is set on that class;
- every field the driver reads from ``Generator.iterate()``'s results, per ``"stage"``
  it tells apart (a read inside ``if stage == "error":`` must be a field of the library's
  ``"error"`` results), and every value it compares a field with (``"max_new_tokens"``);
- the names ``_Library`` holds are exported, ``PAGE_SIZE`` is the backend's page size.

:func:`problems` returns what does not hold, one line each; ``python -m
tests.backends.exllamav3_contract DIR`` prints them for a source folder.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pool.backends import exllamav3 as backend

BACKEND_SOURCE = Path(backend.__file__)

# Where each class the backend uses is defined in the package.
CLASS_FILES = {
    "Config": "model/config.py",
    "Model": "model/model.py",
    "Cache": "cache/cache.py",
    "CacheLayer_fp16": "cache/fp16.py",
    "CacheLayer_quant": "cache/quant.py",
    "Tokenizer": "tokenizer/tokenizer.py",
    "Generator": "generator/generator.py",
    "Job": "generator/job.py",
    "ComboSampler": "generator/sampler/presets.py",
}
# A **kwargs that a method hands to another class: Cache passes the keywords it does not
# take to its layer type (cache/cache.py: ``layer_type(..., **layer_kwargs)``).
_FORWARDS = {("Cache", "__init__"): ("CacheLayer_quant", "__init__")}
# The files whose dict literals with a "stage" key are Generator.iterate()'s results.
RESULT_FILES = ("generator/generator.py", "generator/job.py")
# The backend's names for exllamav3 objects: lib.X is the class X; these receivers are
# instances of a class.
_LIB_NAMES = {"lib", "_lib"}
_RECEIVERS = {
    "generator": "Generator",
    "_generator": "Generator",
    "model": "Model",
    "tokenizer": "Tokenizer",
    "_tokenizer": "Tokenizer",
    "config": "Config",
}
# The variable the driver holds one result in, and the field that tells results apart.
_RESULT = "result"
_STAGE = "stage"


@dataclass
class Call:
    """One call the backend makes into exllamav3."""

    cls: str
    method: str
    positional: int
    keywords: set[str]
    line: int


@dataclass
class Uses:
    """What the backend's source uses of exllamav3."""

    calls: list[Call] = field(default_factory=list)
    attributes: set[tuple[str, str]] = field(default_factory=set)
    # stage -> the result fields read for results of that stage
    fields: dict[str, set[str]] = field(default_factory=dict)
    # (field, value) the driver compares a result field with
    values: set[tuple[str, str]] = field(default_factory=set)
    unresolved: list[str] = field(default_factory=list)


def _dotted(node: ast.expr) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _target(call: ast.Call) -> tuple[str, str] | None:
    """(class, method) of a call into exllamav3; None for any other call."""
    parts = _dotted(call.func)
    for i, part in enumerate(parts):
        if part in _LIB_NAMES:
            rest = parts[i + 1 :]
            if len(rest) == 1:
                return rest[0], "__init__"
            if len(rest) == 2:
                return rest[0], rest[1]
            return None
    if len(parts) >= 2 and parts[-2] in _RECEIVERS:
        return _RECEIVERS[parts[-2]], parts[-1]
    return None


def _mapping_keys(tree: ast.Module) -> dict[str, set[str]]:
    """Keys the backend puts in each local mapping name (``load_kwargs["device"] = ...``)."""
    keys: dict[str, set[str]] = {}

    def add(name: str, key: object) -> None:
        if isinstance(key, str):
            keys.setdefault(name, set()).add(key)

    for node in ast.walk(tree):
        value: ast.expr | None = None
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        for target in targets:
            if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
                for key in value.keys:
                    if isinstance(key, ast.Constant):
                        add(target.id, key.value)
            elif (
                isinstance(target, ast.Subscript)
                and isinstance(target.value, ast.Name)
                and isinstance(target.slice, ast.Constant)
            ):
                add(target.value.id, target.slice.value)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name)
        ):
            for keyword in node.keywords:
                if keyword.arg is not None:
                    add(node.func.value.id, keyword.arg)
    return keys


def _read_field(node: ast.AST) -> str | None:
    """The field of ``result["x"]`` or ``result.get("x", ...)``."""
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == _RESULT
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ):
        return node.slice.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == _RESULT
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def backend_uses(source: Path = BACKEND_SOURCE) -> Uses:
    """Read what the backend uses of exllamav3 from its source."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    uses = Uses()
    mappings = _mapping_keys(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = _target(node)
        if target is not None:
            keywords: set[str] = set()
            for keyword in node.keywords:
                if keyword.arg is not None:
                    keywords.add(keyword.arg)
                    continue
                name = _dotted(keyword.value)[-1:]
                if not name or name[0] not in mappings:
                    mapping = ast.unparse(keyword.value)
                    uses.unresolved.append(
                        f"line {node.lineno}: cannot tell the keys of **{mapping}"
                    )
                    continue
                keywords |= mappings[name[0]]
            starred = any(isinstance(arg, ast.Starred) for arg in node.args)
            if starred:
                uses.unresolved.append(f"line {node.lineno}: cannot count *args")
            uses.calls.append(Call(*target, len(node.args), keywords, node.lineno))
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in _RECEIVERS
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            uses.attributes.add((_RECEIVERS[node.args[0].id], node.args[1].value))
    _result_reads(tree, uses)
    return uses


def _result_reads(tree: ast.Module, uses: Uses) -> None:
    """The result fields the driver reads, attributed to the stage it checked first.

    Inside ``if stage == "X":`` (``stage`` bound from ``result.get("stage")``) a read
    belongs to stage X, also through a call ``self.f(..., result)``; a read outside every
    such branch belongs to each stage the driver compares with.
    """
    functions = _functions(tree)
    stages: set[str] = set()
    reads: list[tuple[str | None, str]] = []

    def compared(test: ast.expr, aliases: dict[str, str]) -> tuple[str, str] | None:
        if not (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.comparators[0], ast.Constant)
            and isinstance(test.comparators[0].value, str)
        ):
            return None
        left = test.left
        name = _read_field(left)
        if name is None and isinstance(left, ast.Name):
            name = aliases.get(left.id)
        return None if name is None else (name, test.comparators[0].value)

    def visit(node: ast.AST, stage: str | None, aliases: dict[str, str], seen: set[str]) -> None:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = _read_field(node.value)
            if name is not None and isinstance(node.targets[0], ast.Name):
                aliases[node.targets[0].id] = name
        field_name = _read_field(node)
        if field_name is not None:
            reads.append((stage, field_name))
        if isinstance(node, ast.Compare):
            pair = compared(node, aliases)
            if pair is not None:
                uses.values.add(pair)
                if pair[0] == _STAGE:
                    stages.add(pair[1])
        if isinstance(node, ast.If):
            visit(node.test, stage, aliases, seen)
            pair = compared(node.test, aliases)
            branch = pair[1] if pair is not None and pair[0] == _STAGE else stage
            for child in node.body:
                visit(child, branch, aliases, seen)
            for child in node.orelse:
                visit(child, stage, aliases, seen)
            return
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
            and any(isinstance(arg, ast.Name) and arg.id == _RESULT for arg in node.args)
            and node.func.attr in functions
            and node.func.attr not in seen
        ):
            for child in functions[node.func.attr].body:
                visit(child, stage, {}, seen | {node.func.attr})
        for child in ast.iter_child_nodes(node):
            visit(child, stage, aliases, seen)

    driver = [
        node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "_Driver"
    ]
    if not driver:
        uses.unresolved.append("no _Driver class in the backend")
        return
    step = _functions(driver[0]).get("_step")
    if step is None:
        uses.unresolved.append("no _Driver._step in the backend")
        return
    visit(step, None, {}, {"_step"})
    for stage, name in reads:
        for each in [stage] if stage is not None else sorted(stages):
            uses.fields.setdefault(each, set()).add(name)


# -- the library's side ---------------------------------------------------------------


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name == name:
            return item
    return None


def _decorators(function: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d) for d in function.decorator_list}


def _accepts_keyword(cls: ast.ClassDef, method: ast.FunctionDef, keyword: str) -> bool:
    args = method.args
    if keyword in {a.arg for a in [*args.args, *args.kwonlyargs]}:
        return True
    if args.kwarg is None:
        return False
    # **kwargs handed on to another method of the class: that one must take it.
    for node in ast.walk(method):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
            and any(
                k.arg is None and isinstance(k.value, ast.Name) and k.value.id == args.kwarg.arg
                for k in node.keywords
            )
        ):
            forwarded = _method(cls, node.func.attr)
            if forwarded is not None and forwarded is not method:
                return _accepts_keyword(cls, forwarded, keyword)
    return False


def _positional_room(method: ast.FunctionDef) -> int | None:
    """How many positional arguments a call may pass; None when ``*args`` takes any."""
    args = method.args
    if args.vararg is not None:
        return None
    count = len(args.posonlyargs) + len(args.args)
    return count if "staticmethod" in _decorators(method) else count - 1


def _sets_attribute(cls: ast.ClassDef, name: str) -> bool:
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return True  # a property or method
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and target.id == name:
                return True
            if (
                isinstance(target, ast.Attribute)
                and target.attr == name
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                return True
    return False


@dataclass
class Results:
    """The library's result dicts: stage -> fields, and the values a field is given."""

    fields: dict[str, set[str]] = field(default_factory=dict)
    values: dict[str, set[str]] = field(default_factory=dict)


def _enclosing_functions(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    """Top-level functions and methods (nested functions are part of theirs)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.Module):
            yield from (n for n in node.body if isinstance(n, ast.FunctionDef))


def library_results(root: Path) -> Results:
    """Fields of every dict literal with a constant ``"stage"`` (and of its ``.update()``s
    in the same function), and each field's constant values in those files."""
    results = Results()
    for path in RESULT_FILES:
        file = root / path
        if not file.is_file():
            continue
        tree = ast.parse(file.read_text(encoding="utf-8"))
        # Constant values given to a name (eos_reason="max_new_tokens", or assigned).
        given: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if isinstance(keyword.value, ast.Constant) and isinstance(
                        keyword.value.value, str
                    ):
                        given.setdefault(str(keyword.arg), set()).add(keyword.value.value)
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for target in node.targets:
                    name = _dotted(target)[-1:] if isinstance(target, ast.expr) else []
                    if name:
                        given.setdefault(name[0], set()).add(node.value.value)
        for function in _enclosing_functions(tree):
            for node in ast.walk(function):
                if not isinstance(node, ast.Dict):
                    continue
                entries = {
                    k.value: v
                    for k, v in zip(node.keys, node.values, strict=True)
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)
                }
                stage = entries.get(_STAGE)
                if not (isinstance(stage, ast.Constant) and isinstance(stage.value, str)):
                    continue
                fields = results.fields.setdefault(stage.value, set())
                values: list[tuple[str, ast.expr]] = list(entries.items())
                for variable in _assigned_to(function, node):
                    values += _updates(function, variable)
                for name, value in values:
                    fields.add(name)
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        results.values.setdefault(name, set()).add(value.value)
                    elif isinstance(value, ast.Name):
                        results.values.setdefault(name, set()).update(given.get(value.id, set()))
    return results


def _assigned_to(function: ast.FunctionDef, value: ast.Dict) -> set[str]:
    return {
        target.id
        for node in ast.walk(function)
        if isinstance(node, ast.Assign) and node.value is value
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _updates(function: ast.FunctionDef, variable: str) -> list[tuple[str, ast.expr]]:
    """(key, value) of every ``variable.update({...})`` / ``variable.update(k=...)``."""
    entries: list[tuple[str, ast.expr]] = []
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == variable
        ):
            for arg in node.args:
                if isinstance(arg, ast.Dict):
                    entries += [
                        (k.value, v)
                        for k, v in zip(arg.keys, arg.values, strict=True)
                        if isinstance(k, ast.Constant) and isinstance(k.value, str)
                    ]
            entries += [(k.arg, k.value) for k in node.keywords if k.arg is not None]
    return entries


def _exports(root: Path) -> set[str]:
    """Top-level names of the package: ``from ... import`` in ``__init__.py``, with the
    names of a star import's module."""
    names: set[str] = set()
    init = root / "__init__.py"
    for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if alias.name != "*":
                names.add(alias.asname or alias.name)
                continue
            module = root.joinpath(*(node.module or "").split("."))
            star = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
            if star.is_file():
                for inner in ast.walk(ast.parse(star.read_text(encoding="utf-8"))):
                    if isinstance(inner, ast.ImportFrom):
                        names |= {a.asname or a.name for a in inner.names if a.name != "*"}
    return names


def source_version(root: Path) -> str | None:
    """``__version__`` of ``exllamav3/version.py``, read without importing."""
    path = root / "version.py"
    if not path.is_file():
        return None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    return None


def problems(root: Path, uses: Uses | None = None) -> list[str]:
    """What the backend uses that the exllamav3 source at ``root`` does not have."""
    uses = uses or backend_uses()
    found: list[str] = list(uses.unresolved)
    trees: dict[str, ast.Module] = {}

    def class_def(name: str) -> ast.ClassDef | None:
        path = CLASS_FILES.get(name)
        if path is None:
            found.append(f"{name}: the check does not know where exllamav3 defines it")
            return None
        if path not in trees:
            file = root / path
            if not file.is_file():
                found.append(f"{name}: {path} is missing")
                return None
            trees[path] = ast.parse(file.read_text(encoding="utf-8"))
        cls = _class(trees[path], name)
        if cls is None:
            found.append(f"{name}: no class {name} in {path}")
        return cls

    exported = _exports(root)
    for name in (f.name for f in dataclasses.fields(backend._Library)):
        if name not in exported:
            found.append(f"{name}: not exported by exllamav3/__init__.py")
        class_def(name)
    for call in uses.calls:
        cls = class_def(call.cls)
        if cls is None:
            continue
        where = f"{call.cls}.{call.method} (backend line {call.line})"
        method = _method(cls, call.method)
        if method is None:
            found.append(f"{where}: no such method")
            continue
        room = _positional_room(method)
        if room is not None and call.positional > room:
            found.append(
                f"{where}: takes {room} positional arguments, the backend passes {call.positional}"
            )
        forward = _FORWARDS.get((call.cls, call.method))
        forward_cls = class_def(forward[0]) if forward is not None else None
        forward_method = (
            _method(forward_cls, forward[1])
            if forward is not None and forward_cls is not None and method.args.kwarg is not None
            else None
        )
        for keyword in sorted(call.keywords):
            if _accepts_keyword(cls, method, keyword):
                continue
            if (
                forward_cls is not None
                and forward_method is not None
                and _accepts_keyword(forward_cls, forward_method, keyword)
            ):
                continue
            found.append(f"{where}: no keyword argument {keyword!r}")
    for cls_name, attribute in sorted(uses.attributes):
        cls = class_def(cls_name)
        if cls is not None and not _sets_attribute(cls, attribute):
            found.append(f"{cls_name}.{attribute}: never set")
    results = library_results(root)
    for stage, fields in sorted(uses.fields.items()):
        if stage not in results.fields:
            found.append(f'results: no "stage": {stage!r} result in {", ".join(RESULT_FILES)}')
            continue
        for name in sorted(fields - results.fields[stage]):
            found.append(f"results: {stage!r} results have no field {name!r}")
    for name, value in sorted(uses.values):
        if name != _STAGE and value not in results.values.get(name, set()):
            found.append(f"results: field {name!r} never takes the value {value!r}")
    page_size = _constant(root / "constants.py", "PAGE_SIZE")
    if page_size != backend._PAGE_SIZE:
        found.append(
            f"constants.PAGE_SIZE is {page_size}, the backend assumes {backend._PAGE_SIZE}"
        )
    return found


def _constant(path: Path, name: str) -> object:
    if not path.is_file():
        return None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and isinstance(node.value, ast.Constant)
        ):
            return node.value.value
    return None


if __name__ == "__main__":
    root = Path(sys.argv[1])
    print(f"exllamav3 source {root}: version {source_version(root)}")
    print("\n".join(problems(root)) or "no problems")
