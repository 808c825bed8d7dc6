"""Tokens/s of SmolLM2 through the pool's ``vllm`` backend vs the same engine driven directly.

One engine serves both sides, so the ratio is the pool's own cost (Trio, the scheduler,
the hand-over between Trio and the engine's asyncio loop), not a difference between two
engines. The direct side runs vLLM's ``AsyncLLM.generate`` as an asyncio program on the
engine's own loop (the prompt rendered the same way, the same sampling); the pool side
sends the same requests through ``pool.stream``. Both at 1 and at 8 requests at once,
interleaved round by round (A B, B A, ...) so drift on a shared machine hits both.

vLLM is not in the pool's environment; run it in vLLM's (``scripts/build-vllm-env
--with-pool`` prints that Python) with the checkout on PYTHONPATH::

    PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 $(bash scripts/build-vllm-env --with-pool) \\
        -m benchmarks.vllm_direct --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

from benchmarks._machine import describe
from pool import Delta, Finished, InferenceRequest, open_pool
from pool.actors import DecodingOverrides
from pool.config import build_settings

QUESTION = "Write a short story about a lighthouse keeper."
MAX_TOKENS = 64
MAX_MODEL_LEN = 1024
CONCURRENCY = (1, 8)


def _request() -> InferenceRequest:
    return InferenceRequest.prompt(
        "v", QUESTION, decoding=DecodingOverrides(max_tokens=MAX_TOKENS, temperature=0)
    )


async def pool_batch(pool: Any, n: int) -> dict[str, float]:
    """``n`` requests at once through the pool: tokens/s over the batch's wall time."""
    tokens: list[int] = []
    firsts: list[float] = []
    started = time.perf_counter()

    async def one() -> None:
        produced = 0
        async for event in pool.stream(_request()):
            if isinstance(event, Delta) and not produced:
                firsts.append(time.perf_counter() - started)
                produced = 1
            elif isinstance(event, Finished):
                produced = event.usage.output_tokens or produced
        tokens.append(produced)

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    wall = time.perf_counter() - started
    return {
        "tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / wall,
        "ttft_ms": statistics.median(firsts) * 1000,
    }


def direct_batch_work(prompt: str, n: int, round_index: int) -> Any:
    """``await work(engine)``: ``n`` generations straight through ``AsyncLLM.generate``."""

    async def work(engine: Any) -> dict[str, float]:
        import asyncio

        from vllm import SamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        started = time.perf_counter()
        firsts: list[float] = []

        async def one(index: int) -> int:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=MAX_TOKENS,
                output_kind=RequestOutputKind.DELTA,
                stop_token_ids=[engine.get_tokenizer().eos_token_id],
            )
            parsed = parse_model_prompt(engine.model_config, {"prompt": prompt})
            (engine_input,) = await engine.renderer.render_cmpl_async(
                [parsed], engine.renderer.default_cmpl_tok_params
            )
            produced = 0
            seen_text = False
            async for output in engine.generate(
                engine_input, params, f"direct-{round_index}-{index}"
            ):
                # The first text, as on the pool's side (a token that decodes to no
                # text yet, such as part of a character, is not a delta there).
                if not seen_text and output.outputs[0].text:
                    firsts.append(time.perf_counter() - started)
                    seen_text = True
                produced += len(output.outputs[0].token_ids)
            return produced

        counts = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - started
        return {
            "tokens": sum(counts),
            "tokens_per_s": sum(counts) / wall,
            "ttft_ms": statistics.median(firsts) * 1000,
        }

    return work


async def main(rounds: int, out: Path | None, model: str) -> dict[str, Any]:
    import vllm

    from pool.backends.vllm import VllmRuntime

    settings = build_settings(
        {
            "engine": {
                "models": {
                    "v": {
                        "backend": "vllm",
                        "vllm_model": model,
                        "prompt_format": "model_template",
                        "vllm_max_model_len": MAX_MODEL_LEN,
                        "vllm_dtype": "float32",
                        "vllm_max_num_seqs": max(CONCURRENCY),
                        # Eager (no torch.compile): a start of about a minute instead
                        # of four on 2 cores; both sides run the same engine anyway.
                        "vllm_enforce_eager": True,
                        "enabled": True,
                    }
                }
            }
        }
    )
    results: dict[str, list[dict[str, float]]] = {
        f"{side}_{n}": [] for n in CONCURRENCY for side in ("pool", "direct")
    }
    async with open_pool(settings) as pool:
        runtime = pool.model("v").replicas[0].runtime
        assert isinstance(runtime, VllmRuntime)
        from pool.backends import Decoding, GenerationRequest

        rendered = runtime.render(
            GenerationRequest("bench", "v", _request().turns, Decoding(max_tokens=MAX_TOKENS))
        )
        counter = 0

        async def direct(n: int) -> dict[str, float]:
            nonlocal counter
            counter += 1
            return await runtime.host.run_on_engine(direct_batch_work(rendered.text, n, counter))

        for n in CONCURRENCY:  # warm-up, both sides
            await pool_batch(pool, n)
            await direct(n)
        for index in range(rounds):
            for n in CONCURRENCY:
                order = ("pool", "direct") if index % 2 == 0 else ("direct", "pool")
                for side in order:
                    run = await pool_batch(pool, n) if side == "pool" else await direct(n)
                    results[f"{side}_{n}"].append(run)
                print(
                    f"round {index + 1}/{rounds}, {n} at once: pool"
                    f" {results[f'pool_{n}'][-1]['tokens_per_s']:.1f} tok/s, direct"
                    f" {results[f'direct_{n}'][-1]['tokens_per_s']:.1f} tok/s",
                    file=sys.stderr,
                )
    summary = {
        key: {
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "median_ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            "median_tokens": statistics.median(r["tokens"] for r in runs),
        }
        for key, runs in results.items()
    }
    ratios = {
        n: summary[f"pool_{n}"]["median_tokens_per_s"]
        / summary[f"direct_{n}"]["median_tokens_per_s"]
        for n in CONCURRENCY
    }
    report = {
        "benchmark": "vllm_direct",
        "command": (
            "PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 $(bash scripts/build-vllm-env --with-pool)"
            f" -m benchmarks.vllm_direct --rounds {rounds}"
        ),
        "machine": {**describe(), "vllm": vllm.__version__},
        "settings": {
            "max_tokens": MAX_TOKENS,
            "max_model_len": MAX_MODEL_LEN,
            "dtype": "float32",
            "enforce_eager": True,
            "temperature": 0,
            "prompt": QUESTION,
            "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        },
        "summary": summary,
        "ratio_tokens_per_s": {str(n): r for n, r in ratios.items()},
        "runs": results,
    }
    if out is not None:
        write_report(out, report, rounds)
    return report


def write_report(out: Path, report: dict[str, Any], rounds: int) -> None:
    summary, machine = report["summary"], report["machine"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_direct.json").write_text(json.dumps(report, indent=2))
    rows = "".join(
        f"| {n} | {summary[f'pool_{n}']['median_tokens_per_s']:.1f}"
        f" | {summary[f'direct_{n}']['median_tokens_per_s']:.1f}"
        f" | **{report['ratio_tokens_per_s'][str(n)]:.3f}**"
        f" | {summary[f'pool_{n}']['median_ttft_ms']:.0f}"
        f" | {summary[f'direct_{n}']['median_ttft_ms']:.0f} |\n"
        for n in CONCURRENCY
    )
    (out / "vllm_direct.md").write_text(
        "# vllm (in-process) through the pool vs the same engine driven directly\n\n"
        f"Command: `{report['command']}`  \n"
        f"Machine: {machine['cpu']}, {machine['cores']} cores (nproc), Python"
        f" {machine['python']}, vLLM {machine['vllm']} (vllm-cpu), load average at start"
        f" {' '.join(machine['loadavg_at_start'] or [])}\n\n"
        f"SmolLM2-135M-Instruct (the float32 transformers checkout of `llm-pool convert`),"
        f" max_model_len {report['settings']['max_model_len']}, 1 GiB of KV cache, eager"
        " (no torch.compile); prompt"
        f" {report['settings']['prompt']!r} in the model's ChatML template, greedy,"
        f" max_tokens {report['settings']['max_tokens']}. Tokens/s: every request's tokens"
        " over the batch's wall time; time to first token: to the first text. Medians of"
        f" {rounds} interleaved rounds; one engine serves both sides.\n\n"
        "| at once | pool tokens/s | direct tokens/s | pool / direct | pool TTFT ms"
        " | direct TTFT ms |\n|---|---|---|---|---|---|\n" + rows
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm"))
    parser.add_argument("--model", help="the transformers checkout (default: llm-pool convert's)")
    args = parser.parse_args()
    model = args.model or os.environ.get("LLM_POOL_VLLM_TEST_MODEL")
    if model is None:
        from pool.convert import cached_model

        model = str(cached_model("transformers"))
    report = trio.run(main, args.rounds, args.out, model)
    print(json.dumps({k: report[k] for k in ("summary", "ratio_tokens_per_s")}, indent=2))
