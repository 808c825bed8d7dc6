"""``python -m benchmarks.house_figures``: the figures of issue #43's first two items.

- ``ModelActor``'s size: the lines of its class statement, its methods (every ``def``
  in the class body, properties included) and its attributes (the distinct names it
  assigns on ``self`` anywhere in the class).
- How many times an admin load enters ``pool/actors/models/_model.py`` before the first "does
  it fit" answer: the calls (profile ``call`` events, so a property read counts as
  one) into functions written in that file, made by the task that runs
  ``Pool.load`` (the admin route's call), from its start until the first return of
  the fit decision (the planner's ``plan``, or before it the gate's ``fit``). The
  setup: two stub models on one virtual GPU, ``a`` loaded, then ``b`` loaded.

It changes nothing and measures no time.
"""

from __future__ import annotations

import ast
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
MODEL_FILE = ROOT / "pool" / "actors" / "models" / "_model.py"
# (file, function) pairs whose first return is the fit decision.
FIT_ANSWERS = {("_planner.py", "plan"), ("_gate.py", "fit")}


def actor_size() -> dict[str, int]:
    tree = ast.parse(MODEL_FILE.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelActor")
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    attributes: set[str] = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.value, ast.Name)
                    and part.value.id == "self"
                ):
                    attributes.add(part.attr)
    assert cls.end_lineno is not None
    return {
        "lines": cls.end_lineno - cls.lineno + 1,
        "methods": len(methods),
        "attributes": len(attributes),
    }


async def admin_load_passes() -> int:
    from pool import open_pool
    from pool.config import build_settings

    def stub(mib: int) -> dict[str, Any]:
        return {"backend": "stub", "stub_vram_mib": mib}

    settings = build_settings(
        {
            "engine": {
                "gpu_budget_mib": [1000],
                "min_resident_s": 0,
                "models": {"a": stub(600), "b": stub(600)},
            }
        }
    )
    async with open_pool(settings) as pool:
        await pool.load("a")
        task = trio.lowlevel.current_task()
        model_file = str(MODEL_FILE)
        count = 0
        answered = False

        def profile(frame: FrameType, event: str, arg: object) -> None:
            nonlocal count, answered
            if answered:
                return
            try:
                if trio.lowlevel.current_task() is not task:
                    return
            except RuntimeError:  # Trio's own scheduling, between tasks
                return
            code = frame.f_code
            if event == "call" and code.co_filename == model_file:
                count += 1
            elif event == "return" and (Path(code.co_filename).name, code.co_name) in FIT_ANSWERS:
                answered = True

        sys.setprofile(profile)
        try:
            await pool.load("b")
        finally:
            sys.setprofile(None)
        assert answered, "the load never reached the fit decision"
        return count


def main() -> None:
    os.environ["LLM_POOL_STATE_DIR"] = tempfile.mkdtemp(prefix="house-figures-")
    print("ModelActor:", actor_size())
    print("calls into _model.py before the fit answer:", trio.run(admin_load_passes))


if __name__ == "__main__":
    main()
