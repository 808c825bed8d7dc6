"""Profile the pool with py-spy under one ``relay-capacity`` load, and summarize it.

    python -m benchmarks.profile pool_chat --streams 64 --seconds 15 --out chat.txt
    python -m benchmarks.profile json_stub --streams 8           # JSON, stub model
    python -m benchmarks.profile json_relay --streams 8 --svg --out json.svg  # flame graph

Sides: ``pool_chat``, ``pool_responses`` (through ``openai_remote`` to the zero-work
upstream), ``stub_chat``, ``stub_responses`` (in-process stub), ``json_stub`` and
``json_relay`` (one-token JSON answers). py-spy (``pip install py-spy``) samples the
pool process at 200 Hz while the load runs; the summary prints the share of samples by
function (self and inclusive) and by module; with ``--svg`` it writes py-spy's flame
graph instead. ``--pythonpath DIR`` serves another checkout's pool (``git archive REV
pool | tar -x -C DIR``), for a before/after pair from one machine.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
from pathlib import Path
from typing import Any

import trio

from benchmarks import relay
from benchmarks._http import CHAT_DELTA_MARK, DELTA_MARK
from benchmarks.harness import pool_server, zero_upstream
from benchmarks.stub_bodies import stub_text

_stream_body = relay._body
_JSON = {
    "json_stub": ("pool", "/v1/responses", "stub", DELTA_MARK),
    "json_relay": ("pool", "/v1/chat/completions", "relay", CHAT_DELTA_MARK),
}


def _json_body(path: str, model: str, stream: bool = False) -> dict[str, Any]:
    body = {**_stream_body(path, model), "stream": False}
    if path == "/v1/responses":
        body["decoding"] = {"max_tokens": 1}
    else:
        body["max_tokens"] = 1
    return body


async def run(
    side_name: str,
    streams: int,
    seconds: float,
    out: Path | None,
    svg: bool = False,
    pythonpath: Path | None = None,
) -> dict[str, Any]:
    sides = {**relay._SIDES, **relay._STUB_SIDES, **_JSON}
    side = sides[side_name]
    if side_name in _JSON:
        relay._body = _json_body  # type: ignore[assignment]
    with zero_upstream() as upstream:
        models = {
            "relay": {
                "backend": "openai_remote",
                "enabled": True,
                "remote_base_url": f"{upstream.url}/v1",
                "remote_model": "zero",
                "target_inflight": 256,
            },
            "stub": {
                "backend": "stub",
                "enabled": True,
                "stub_reply": stub_text(relay.TOKENS),
                "target_inflight": 256,
            },
        }
        with pool_server(models, checkout=pythonpath) as pool:
            servers = {"upstream": upstream, "pool": pool}
            await relay._phase(servers, side, 4, 0.5)  # warm-up
            spy = None
            if out is not None:
                binary = shutil.which("py-spy") or "py-spy"
                spy = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block
                    [binary, "record", "-p", str(pool.process.pid), "-d", str(int(seconds)),
                     "-r", "200", "-f", "flamegraph" if svg else "raw", "-o", str(out),
                     "--nonblocking"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
            summary = await relay._phase(servers, side, streams, seconds)
            if spy is not None:
                await trio.to_thread.run_sync(spy.wait)
            return summary


def summarize_profile(path: Path, top: int = 25) -> str:
    """Shares of samples: by function (self, inclusive) and by module (self)."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    modules: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples = int(count)
        total += samples
        names = [_frame(frame) for frame in stack.split(";")]
        own[names[-1]] += samples
        modules[names[-1].split(" (", 1)[1].rstrip(")")] += samples
        for name in set(names):
            inclusive[name] += samples

    def table(title: str, counter: collections.Counter[str], rows: int) -> list[str]:
        return [f"--- {title}"] + [
            f"{100 * n / total:5.1f}% {name}" for name, n in counter.most_common(rows)
        ]

    lines = [f"{total} samples"]
    lines += table("self, by function", own, top)
    lines += table("inclusive, by function", inclusive, top + 15)
    lines += table("self, by module", modules, top)
    return "\n".join(lines) + "\n"


def _frame(frame: str) -> str:
    """``func (path/to/file.py:12)`` as ``func (package/file.py)``."""
    function, _, where = frame.partition(" (")
    where = where.rsplit(":", 1)[0].rstrip(")")
    for marker in ("site-packages/", "python3.11/"):
        if marker in where:
            where = where.split(marker, 1)[1]
            break
    else:
        for marker in ("/pool/", "/benchmarks/"):
            if marker in where:
                where = marker.lstrip("/") + where.split(marker, 1)[1]
                break
    return f"{function} ({where})"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    parser.add_argument("side")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--out", type=Path, help="py-spy's raw profile (none: no py-spy)")
    parser.add_argument("--svg", action="store_true", help="--out is py-spy's flame graph")
    parser.add_argument("--pythonpath", type=Path, help="serve the pool from this checkout")
    args = parser.parse_args()
    summary = trio.run(
        run, args.side, args.streams, args.seconds, args.out, args.svg, args.pythonpath
    )
    print(
        f"{args.side} streams={args.streams}: {summary['tokens_per_s']:.0f} tokens/s,"
        f" {summary['requests_per_s']:.0f} requests/s,"
        f" pool CPU {summary['server_cpu_ms_per_request']:.3f} ms/request"
        + (
            f", {summary['pool_cpu_ms_per_token']:.4f} ms/token"
            if args.side not in _JSON and summary["pool_cpu_ms_per_token"]
            else ""
        )
    )
    if args.out is not None and not args.svg:
        summary_path = args.out.with_suffix(".summary.txt")
        summary_path.write_text(summarize_profile(args.out))
        print(summary_path.read_text())


if __name__ == "__main__":
    main()
