"""Run the examples of README.md and docs/*.md against a pool on the shipped settings.

Every ```sh and ```python block runs, in document order, against a fresh pool per file,
unless the line just before it is ``<!-- not run in CI: reason -->``; the marked blocks
must be exactly ``EXPECTED_SKIPPED`` so that a new example is run unless someone marks it
on purpose.

An exit code alone proves little (``curl -s`` exits 0 on a 404, and an Ollama error is a
JSON string like any other), so each run example is held to an ``Expect``: every curl
call it makes, recorded by a ``curl`` shim first on ``PATH``, to its HTTP status and the
shape of its body (the content too where the docs show it), and what the block prints (the
``llm-pool`` commands, the Python examples) to what it should say. No recorded body may
carry an error: a JSON ``error``, an SSE ``error`` or ``response.failed`` event, an NDJSON
line with ``error``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!-- not run in CI: (.*?) -->\s*$")

# (file, first line of the block) for each block marked not runnable here.
EXPECTED_SKIPPED = {
    ("README.md", "scripts/serve"),
    ("README.md", "scripts/test"),
    ("api.md", "curl -sN localhost:8011/v1/admin/events"),
    ("api.md", "from openai import OpenAI"),  # the embeddings example: no embedding model
    ("api.md", "import httpx"),  # the rerank example: no rerank model
    ("backends.md", "llm-pool convert ct2"),
    ("operations.md", "scripts/serve"),
    ("operations.md", "deploy/systemd/install.sh"),
    ("operations.md", "docker build -f deploy/docker/Dockerfile.cpu -t llm-pool:cpu ."),
    ("operations.md", "llm-pool pull my-model"),
    ("performance.md", "pip install -e '.[test,llama-cpp,bench]'"),
}


@dataclass(frozen=True)
class Example:
    file: str
    line: int
    language: str
    code: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return self.code.splitlines()[0].split("  #")[0].strip()


def examples(path: Path) -> list[Example]:
    text = path.read_text()
    found = []
    for m in BLOCK.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.match(before)
        found.append(
            Example(
                path.name,
                text[: m.start()].count("\n") + 1,
                m.group(1),
                m.group(2),
                mark.group(1) if mark else None,
            )
        )
    return found


ALL = [ex for path in DOCS for ex in examples(path)]
RUN = [ex for ex in ALL if not ex.skip_reason]


# --- What a curl call answered -------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One curl call of an example, as the shim recorded it."""

    args: tuple[str, ...]
    status: int
    body: str

    def __str__(self) -> str:
        return f"curl {' '.join(self.args)}\n-> {self.status}\n{self.body[:3000]}"

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[tuple[str, Any]]:
        """The Server-Sent Events of the body: (event name, parsed data)."""
        found = []
        for block in re.split(r"\n\n+", self.body.strip()):
            lines = [line for line in block.splitlines() if not line.startswith(":")]
            if not lines:
                continue
            name = next((ln[6:].strip() for ln in lines if ln.startswith("event:")), "message")
            data = "\n".join(ln[5:].strip() for ln in lines if ln.startswith("data:"))
            found.append((name, json.loads(data) if data.startswith(("{", "[")) else data))
        return found


def _is_error(value: object) -> bool:
    """An error in one of the dialects' shapes: the pool's, OpenAI's and Anthropic's
    ``error`` object (Anthropic's and the stream events' ``type: error``), Ollama's
    ``{"error": "message"}``. An ``error`` text beside other fields is a reading's note (the
    GPU readings' ``error`` on a machine without NVML), not a failure."""
    if not isinstance(value, dict):
        return False
    error = value.get("error")
    return (
        value.get("type") in ("error", "response.failed")
        or isinstance(error, dict)
        or (isinstance(error, str) and (set(value) == {"error"} or value.get("status") == "error"))
    )


def _errors_inside(call: Call) -> list[object]:
    """The errors a body carries: an error body, an SSE ``error`` or ``response.failed``
    event, or an NDJSON line with an error."""
    body = call.body.lstrip()
    if body.startswith(("event:", "data:", ":")):
        return [
            (name, data)
            for name, data in call.events()
            if name in ("error", "response.failed") or _is_error(data)
        ]
    if not body.startswith("{"):
        return []
    try:
        values = [json.loads(body)]
    except json.JSONDecodeError:  # NDJSON: one value a line
        values = [json.loads(line) for line in body.splitlines() if line.strip()]
    return [v for v in values if _is_error(v)]


Check = Callable[[Call], None]


def answers(status: int, check: Callable[[Any], object] | None = None) -> Check:
    """The call answered ``status`` with a JSON body (that ``check`` accepts)."""

    def checked(call: Call) -> None:
        assert call.status == status, f"expected {status}"
        body = call.json()
        if check is not None:
            assert check(body), "the body is not what the docs say"

    return checked


def streams(
    text: str, *, names: Callable[[list[str]], bool], data: Callable[[list[Any]], bool]
) -> Check:
    """A 200 stream of Server-Sent Events whose ``response.output_text.delta`` events
    carry ``text`` in pieces, with event names and data that ``names`` and ``data`` accept."""

    def checked(call: Call) -> None:
        assert call.status == 200, "expected 200"
        events = call.events()
        assert names([name for name, _ in events]), "not the events the docs show"
        assert data([value for _, value in events]), "not the events the docs show"
        pieces = [value["delta"] for name, value in events if name == "response.output_text.delta"]
        assert "".join(pieces) == text, pieces

    return checked


def pool_stream(names: list[str]) -> bool:
    """The pool's own stream as docs/api.md shows it."""
    return names[0] == "response.created" and names[-2:] == [
        "response.metrics",
        "response.completed",
    ]


def openai_stream(names: list[str]) -> bool:
    """OpenAI's order (docs/api.md, "OpenAI's Responses API")."""
    return (
        names[:2] == ["response.created", "response.in_progress"]
        and names[-1] == "response.completed"
    )


def numbered(values: list[Any]) -> bool:
    """Every event carries ``sequence_number`` 0, 1, 2, ..."""
    return [v["sequence_number"] for v in values] == list(range(len(values)))


def has(*keys: str) -> Callable[[Any], bool]:
    return lambda body: isinstance(body, dict) and all(k in body for k in keys)


def names_paris(text: object) -> bool:
    return isinstance(text, str) and "Paris" in text


def row(name: str, state: str) -> Callable[[Any], bool]:
    return lambda body: body["name"] == name and body["runtime_state"] == state


def pool_response_names_paris(body: Any) -> bool:
    return (
        body["object"] == "response"
        and body["finish_reason"] == "stop"
        and names_paris(body["output_text"])
        and body["metrics"]["engine_output_tokens"] > 0
    )


def openai_response_names_paris(body: Any) -> bool:
    (message,) = [item for item in body["output"] if item["type"] == "message"]
    return (
        body["status"] == "completed"
        and names_paris(message["content"][0]["text"])
        and body["usage"]["output_tokens"] > 0
    )


# The models the shipped settings load at start.
SHIPPED = {"smollm2-135m-instruct", "stub-echo"}


def lists_shipped_models(body: Any) -> bool:
    return {m["id"] for m in body["data"]} >= SHIPPED


def nonempty_text(text: object) -> bool:
    return isinstance(text, str) and bool(text.strip())


def metrics_text(call: Call) -> None:
    assert call.status == 200
    assert "# TYPE llm_pool_" in call.body


@dataclass(frozen=True)
class Expect:
    """What one example must do: ``marker`` is a piece of its code that names it among
    the examples of ``file``; ``calls`` checks its curl calls, one each, in order;
    ``output`` is what its own output (the ``llm-pool`` commands, Python's prints) holds,
    as regular expressions."""

    file: str
    marker: str
    calls: tuple[Check, ...] = ()
    output: tuple[str, ...] = ()


QUICK_START = answers(200, pool_response_names_paris)
STARTUP = {("place", name) for name in SHIPPED}
AT_START = {"smollm2-135m-instruct": "loaded", "stub-echo": "loaded", "stub-slow": "unloaded"}

EXPECTED = [
    Expect("README.md", "What is the capital of France?", (QUICK_START,)),
    Expect("README.md", "pool.open_pool", output=(r"(?m)^hello stop ", r"hi there")),
    Expect("api.md", '"input": "What is the capital of France?"}', (QUICK_START,)),
    Expect(
        "api.md",
        "Which country is that city in?",
        (answers(200, lambda b: b["object"] == "response" and nonempty_text(b["output_text"])),),
    ),
    Expect(
        "api.md",
        '"input": "one two three", "stream": true',
        (streams("one two three", names=pool_stream, data=lambda values: True),),
    ),
    Expect("api.md", "curl -s localhost:8011/v1/models\n", (answers(200, lists_shipped_models),)),
    Expect(
        "api.md",
        "curl -s localhost:8011/v1/chat/completions",
        (
            answers(
                200,
                lambda b: (
                    b["object"] == "chat.completion"
                    and nonempty_text(b["choices"][0]["message"]["content"])
                ),
            ),
        ),
    ),
    Expect("api.md", 'model="stub-echo", messages=', output=(r"ChatCompletion\(.*'hi'",)),
    Expect(
        "api.md",
        "curl -s localhost:8011/api/chat",
        (answers(200, lambda b: b["done"] is True and b["message"]["content"] == "hello"),),
    ),
    Expect("api.md", "ollama.Client", output=(r"\S",)),
    Expect(
        "api.md",
        '"temperature": 0, "max_output_tokens": 30',
        (answers(200, openai_response_names_paris),),
    ),
    Expect(
        "api.md",
        'input="My name is Ada."',
        # The stream's events, numbered from 0 and ending completed.
        output=(r"(?m)^0 response\.created$", r"(?m)^\d+ response\.completed\n?\Z"),
    ),
    Expect("api.md", "OpenAIResponsesModel", output=(r"(?m)^22 C and sunny in Paris$",)),
    Expect(
        "api.md",
        '"input": "hello world", "stream": true',
        (streams("hello world", names=openai_stream, data=numbered),),
    ),
    Expect(
        "api.md",
        'tool_choice={"type": "function"',
        output=(r'(?m)^get_weather \{"city": ?"Paris"\}$',),
    ),
    Expect(
        "api.md",
        "curl -s localhost:8011/v1/messages",
        (
            answers(
                200,
                lambda b: (
                    b["type"] == "message"
                    and b["content"][0]["type"] == "text"
                    and nonempty_text(b["content"][0]["text"])
                ),
            ),
            answers(200, lambda b: b["input_tokens"] > 0),
        ),
    ),
    Expect(
        "api.md",
        "client.messages.stream",
        output=(r" (end_turn|max_tokens) Usage\(", r"hello\s*\Z"),
    ),
    Expect(
        "api.md",
        'tool_choice={"type": "tool"',
        output=(r"tool_use get_weather \{'city': 'Paris'\}",),
    ),
    Expect(
        "api.md",
        "curl -s localhost:8011/v1/admin/models                 #",
        (
            answers(
                200, lambda b: {r["name"]: r["runtime_state"] for r in b["models"]} == AT_START
            ),
            answers(200, row("stub-slow", "unloaded")),
            answers(200, row("stub-slow", "loaded")),
            answers(200, row("smollm2-135m-instruct", "unloaded")),
            answers(
                200,
                lambda b: row("smollm2-135m-instruct", "loaded")(b) and b["loaded_replicas"] == 2,
            ),
            answers(200, has("gpus", "models", "error")),
            answers(200, has("fits", "evict", "need_mib")),
            answers(200, lambda b: {d["model"] for d in b["decisions"]} == {"stub-slow"}),
        ),
    ),
    Expect(
        "api.md",
        "group_by=model",
        (
            answers(200, lambda b: {r["model"] for r in b["usage"]} >= SHIPPED),
            answers(
                200,
                lambda b: {(r["tenant"], "bucket" in r) for r in b["usage"]} == {("default", True)},
            ),
        ),
    ),
    Expect(
        "api.md",
        "-X POST localhost:8011/v1/admin/keys",
        (
            answers(201, lambda b: b["name"] == "ci-runner" and b["key"].startswith("sk-pool-")),
            answers(200, lambda b: "ci-runner" in {k["name"] for k in b["keys"]}),
            answers(200, lambda b: b["name"] == "ci-runner" and b["revoked"] is True),
        ),
    ),
    Expect(
        "api.md",
        "curl -s localhost:8011/v1/capabilities",
        (
            answers(200, has("capabilities", "resources")),
            answers(202, has("taskId")),
            # TASK_ID is a placeholder the reader replaces: its lookup answers not found.
            answers(404),
            answers(200, lambda b: b["modelId"] == "stub-slow"),
            answers(200, lambda b: b["flushed"] is True),
            answers(200, lambda b: b["status"] in ("healthy", "degraded")),
            answers(200, has("status", "uptime", "engine", "gpu_memory")),
            metrics_text,
        ),
    ),
    Expect(
        "operations.md",
        "llm-pool ps",
        output=(
            r"(?m)^smollm2-135m-instruct +chat +llama_cpp +loaded ",
            r"(?m)^smollm2-135m-instruct: loaded, 2 replica\(s\)",
            r"(?m)^stub-slow would load: fits",
            r"(?m)^stub-slow: loaded, 1 replica\(s\)",
            r"(?m)^\d\d:\d\d:\d\d loaded stub-slow: ",
            r"(?m)^stub-slow: 10 request\(s\)",
            r"(?m)^ *latency \(ms\) +\d",
        ),
    ),
    Expect(
        "operations.md",
        "llm-pool keys add",
        output=(
            r"(?m)^sk-pool-\S{43}$",
            r"(?m)^ci-runner +team-a +inference +- +60 +no +runtime ",
            r"(?m)^key ci-runner revoked$",
        ),
    ),
    Expect(
        "operations.md",
        "llm-pool usage",
        output=(r"(?m)^default +\d+ +\d+ ", r"(?m)^\S+ +stub-slow +10 "),
    ),
    Expect(
        "vram.md",
        "decisions?limit=5",
        (answers(200, lambda b: {(d["action"], d["model"]) for d in b["decisions"]} >= STARTUP),),
        # A fresh pool has not decided about stub-slow, which is not loaded at start.
        output=(r"(?m)no residency decision about stub-slow yet$",),
    ),
    Expect(
        "vram.md",
        "stub-slow/load?dry_run=true",
        (answers(200, lambda b: b["model"] == "stub-slow" and b["fits"] is True),),
    ),
]


def expectation(ex: Example) -> Expect:
    claims = [e for e in EXPECTED if e.file == ex.file and e.marker in ex.code]
    assert len(claims) == 1, f"{ex.file}:{ex.line} {ex.name!r} has {len(claims)} expectations"
    return claims[0]


def test_marked_examples_are_the_expected_ones() -> None:
    skipped = {(ex.file, ex.name) for ex in ALL if ex.skip_reason}
    for ex in ALL:
        if ex.skip_reason:
            print(f"not run: {ex.file}:{ex.line} {ex.name!r}: {ex.skip_reason}")
    assert skipped == EXPECTED_SKIPPED


def test_each_example_run_has_one_expectation_and_each_expectation_an_example() -> None:
    for ex in RUN:
        expectation(ex)
    for e in EXPECTED:
        claimed = [ex for ex in RUN if ex.file == e.file and e.marker in ex.code]
        assert len(claimed) == 1, f"{e.file} {e.marker!r} names {len(claimed)} examples"


ERROR_BODIES = {
    "pool SSE": 'event: response.created\ndata: {"type":"response.created"}\n\n'
    'event: error\ndata: {"type":"error","error":{"code":"backend_error","message":"x"}}\n\n',
    "OpenAI SSE": 'event: response.created\ndata: {"type":"response.created"}\n\n'
    'event: response.failed\ndata: {"type":"response.failed","response":{"status":"failed"}}\n\n',
    "chat SSE": 'data: {"object":"chat.completion.chunk","choices":[]}\n\n'
    'data: {"error":{"message":"x","type":"api_error","param":null,"code":"backend_error"}}\n\n',
    "Anthropic SSE": 'event: message_start\ndata: {"type":"message_start"}\n\n'
    'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n',
    "Ollama NDJSON": '{"model":"m","message":{"content":"a"},"done":false}\n{"error":"unloaded"}\n',
    "Ollama JSON": '{"error": "model \'x\' not found"}',
    "pool JSON": '{\n  "error": {"code": "unknown_model", "message": "x"}\n}',
}
FINE_BODIES = {
    "pool SSE": 'event: response.created\ndata: {"type":"response.created"}\n\n'
    'event: response.completed\ndata: {"type":"response.completed","response":{}}\n\n',
    "OpenAI JSON": '{"object": "response", "status": "completed", "error": null}',
    "GPU readings": '{"gpus": [], "models": [], "error": "no NVIDIA GPU found"}',
    "Ollama NDJSON": '{"message":{"content":"a"},"done":false}\n{"message":{},"done":true}\n',
    "metrics": "# TYPE llm_pool_requests_total counter\n",
}


@pytest.mark.parametrize("body", ERROR_BODIES.values(), ids=ERROR_BODIES.keys())
def test_an_error_in_any_dialect_is_found(body: str) -> None:
    assert _errors_inside(Call((), 200, body))


@pytest.mark.parametrize("body", FINE_BODIES.values(), ids=FINE_BODIES.keys())
def test_an_answer_without_error_passes(body: str) -> None:
    assert not _errors_inside(Call((), 200, body))


# --- Running them ------------------------------------------------------------------

# Records each call: its arguments, its status and its body; prints the body as curl would.
CURL_SHIM = """#!/usr/bin/env bash
n=$(( $(cat "$CURL_RECORD/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$CURL_RECORD/count"
printf '%s\\0' "$@" > "$CURL_RECORD/$n.args"
"$REAL_CURL" "$@" --output "$CURL_RECORD/$n.body" --write-out '%{http_code}' \\
  > "$CURL_RECORD/$n.status"
rc=$?
cat "$CURL_RECORD/$n.body" 2>/dev/null
exit $rc
"""


def _env(state_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    # Keys, usage and stored responses of the examples stay with this run.
    env["LLM_POOL_STATE_DIR"] = str(state_dir)
    return env


@dataclass
class Served:
    url: str
    port: int
    state_dir: Path


@contextmanager
def serving(scratch: Path, local: Path | None = None) -> Iterator[Served]:
    """``llm-pool serve`` on the shipped settings (merged with ``local``, where given: a
    developer's own config/local.json is left out), once every enabled model is loaded."""
    state_dir = scratch / "state"
    local = local or scratch / "no-local.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pool", "serve", "--port", "0", "--local", str(local)],
        cwd=ROOT,
        env=_env(state_dir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    printed: list[str] = []
    listening = threading.Event()

    def read_output() -> None:
        # Read to the end, so that the pool never blocks on a full pipe.
        assert proc.stdout is not None
        for line in proc.stdout:
            printed.append(line)
            if line.startswith("llm-pool listening on "):
                listening.set()
        listening.set()  # it ended: nothing to wait for

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    try:
        # The enabled models load before the pool listens.
        assert listening.wait(300) and proc.poll() is None, "".join(printed)
        url = next(ln for ln in printed if ln.startswith("llm-pool listening on ")).split()[-1]
        rows = httpx.get(f"{url}/v1/admin/models", timeout=30).json()["models"]
        enabled = {r["name"]: r for r in rows if r["configured_enabled"]}
        assert enabled and all(r["runtime_state"] == "loaded" for r in enabled.values()), {
            name: (r["runtime_state"], r["last_error"]) for name, r in enabled.items()
        }
        yield Served(url, int(url.rsplit(":", 1)[1]), state_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serving(tmp_path) as pool:
        yield pool


def _recorded(record: Path) -> list[Call]:
    count = int((record / "count").read_text()) if (record / "count").exists() else 0
    calls = []
    for n in range(1, count + 1):
        status = (record / f"{n}.status").read_text().strip()
        body = record / f"{n}.body"
        calls.append(
            Call(
                tuple((record / f"{n}.args").read_text().split("\0")[:-1]),
                int(status) if status.isdigit() else 0,
                body.read_text() if body.exists() else "",
            )
        )
    return calls


def run_example(ex: Example, served: Served, scratch: Path) -> tuple[str, list[Call]]:
    """Run one example against ``served``: what it printed, and its curl calls."""
    code = re.sub(r"\b(localhost|127\.0\.0\.1):8011\b", rf"\1:{served.port}", ex.code)
    env = _env(served.state_dir)
    env["LLM_POOL_URL"] = served.url
    record = scratch / "curl-calls"
    shims = scratch / "bin"
    record.mkdir()
    shims.mkdir()
    (shims / "curl").write_text(CURL_SHIM)
    (shims / "curl").chmod(0o755)
    env["PATH"] = f"{shims}{os.pathsep}{env['PATH']}"
    env["CURL_RECORD"] = str(record)
    env["REAL_CURL"] = _real_curl()
    command = (
        ["bash", "-e", "-o", "pipefail", "-c", code]
        if ex.language == "sh"
        else [sys.executable, "-c", code]
    )
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    where = f"{ex.file}:{ex.line} {ex.name!r}"
    assert done.returncode == 0, f"{where} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout, _recorded(record)


def _real_curl() -> str:
    found = shutil.which("curl")
    assert found, "the examples need curl"
    return found


def check_example(ex: Example, printed: str, calls: list[Call]) -> None:
    """Hold what ``ex`` did to its ``Expect``."""
    expect = expectation(ex)
    where = f"{ex.file}:{ex.line} {ex.name!r}"
    assert len(calls) == len(expect.calls), (
        f"{where}: {len(calls)} curl calls, {len(expect.calls)} expected\n"
        + "\n".join(map(str, calls))
    )
    for n, (call, check) in enumerate(zip(calls, expect.calls, strict=True)):
        # An error status is the check's to expect (the docs' placeholder TASK_ID is a 404);
        # a success must carry no error, in a stream neither.
        if call.status < 400:
            errors = _errors_inside(call)
            assert not errors, f"{where}: call {n + 1} carries errors {errors}\n{call}"
        try:
            check(call)
        except (AssertionError, KeyError, TypeError, ValueError, IndexError) as e:
            pytest.fail(f"{where}: call {n + 1} {type(e).__name__}: {e}\n{call}")
    for pattern in expect.output:
        assert re.search(pattern, printed), f"{where}: printed no {pattern!r}\n{printed}"


FILES = sorted({ex.file for ex in RUN})


@pytest.mark.real_model
@pytest.mark.parametrize("file", FILES)
def test_examples_run_as_written(file: str, served: Served, tmp_path: Path) -> None:
    for i, ex in enumerate(e for e in RUN if e.file == file):
        scratch = tmp_path / f"example-{i}"
        scratch.mkdir()
        printed, calls = run_example(ex, served, scratch)
        check_example(ex, printed, calls)
