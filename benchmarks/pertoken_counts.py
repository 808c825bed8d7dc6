"""Deterministic per-token counts of the pass-through stream path (issue #44).

    python -m benchmarks.pertoken_counts [--streams 64] [--tokens 256] [--checkout DIR]

A pool serving an ``openai_remote`` model in front of ``benchmarks/zero_upstream.py`` runs
under cProfile (``python -m cProfile -m pool serve``); ``--streams`` clients each read
one ``--tokens``-token Chat Completions stream (the pass-through path), then the pool is
stopped and its profile read. What is printed is divided by the tokens relayed: Python
calls in all, socket sends and receives, task wake-ups (``Runner.reschedule``: a
scheduler pass each), and the calls of the relay's own functions. These counts do not
move with the machine's load (a timed A/B does), so a cut shows in them exactly; the
split of a read into chunks depends on timing, so they vary a little run to run.

    python -m benchmarks.pertoken_counts --per-request [--requests 1000]

counts a one-token JSON request instead (the JSON path's fixed cost): one client sends
``--requests`` Chat Completions, then (a second pool) ten times as many, and the
difference is divided by the extra requests, for two models side by side: the ``stub``
(the pool alone) and ``openai_remote`` in front of the zero upstream (the pass-through
reply, pool/backends/_pass_through.py). Its task wake-ups are also split by what woke
the task (a channel, an event, the I/O manager, or the scheduler resuming a task that
only yielded).

    python -m benchmarks.pertoken_counts --ab DIR [--rounds 5] [--seconds 3]

times instead: two pools without a profiler, this checkout's and the one in ``DIR``
(``git archive REV pool | tar -x -C DIR``), in front of one zero upstream, read in turn
(A B A B ...) at 64 clients of 256-token streams; it prints each side's pool CPU
(user + system, from /proc) per relayed token, every round and the median, with the
load average before and after (the machine is shared: compare within one run only).

    python -m benchmarks.pertoken_counts --ab DIR --per-request [--rounds 12] [--requests 800]

times the JSON path's fixed cost the same way: one client's ``--requests`` one-token
Chat Completions a round on each side, for the ``stub`` and the pass-through reply in
front of the zero upstream (four pools in all), the pools pinned to one
core and the upstream and the client to the other (``benchmarks/pass_through.py``'s
pinning), the order of the sides reversed every round; it prints each side's pool CPU
per request and p50 latency, every round and the medians, and in how many rounds each
side used less CPU than the other.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import trio

from benchmarks import relay
from benchmarks._http import CHAT_DELTA_MARK
from benchmarks.harness import closed_loop, zero_upstream

# (module file ending, function name): what is counted per token.
_WATCH = {
    "socket sends": ("trio/_highlevel_socket.py", "send_all"),
    "socket receives": ("trio/_highlevel_socket.py", "receive_some"),
    "task wake-ups": ("trio/_core/_run.py", "reschedule"),
    "checkpoints": ("trio/_core/_run.py", "checkpoint"),
    "upstream chunks": ("pool/backends/_pass_through.py", "forward"),
    "sink sends": ("pool/actors/models/_replica.py", "send"),
    "tasks started": ("trio/_core/_run.py", "spawn_impl"),
    "cancel scopes": ("trio/_core/_run.py", "__enter__"),  # CancelScope.__enter__
}


def _serve(settings: Path, profile: Path, checkout: Path | None) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "pool", "serve"]
    command += ["--settings", str(settings), "--port", "0", "--log-level", "warning"]
    environ = dict(os.environ)
    if checkout is not None:
        environ["PYTHONPATH"] = str(checkout.resolve())
    return subprocess.Popen(command, stdout=subprocess.PIPE, env=environ, cwd=checkout)


def counts(profile: Path, tokens: int) -> dict[str, float]:
    """What the profile counted, divided by ``tokens``: the watched counts, then every
    function's calls (keyed ``file:line(name)``)."""
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    total = sum(entry[1] for entry in stats.values())
    found = {"python calls": total / tokens}
    for label, (ending, name) in _WATCH.items():
        calls = sum(
            entry[1]
            for (path, _, function), entry in stats.items()
            if function == name and path.endswith(ending)
        )
        found[label] = calls / tokens
    for (path, line, function), entry in stats.items():
        found[f"{path}:{line}({function})"] = entry[0] / tokens
    for label, calls in _wakers(stats).items():
        found[f"woken by {label}"] = calls / tokens
    return found


def _wakers(stats: dict[Any, Any]) -> dict[str, float]:
    """Task wake-ups by what woke the task: each caller of Trio's ``reschedule`` (a
    channel, an event, the I/O manager...) and, a level up, who called that. The second
    level shares a caller's wake-ups out in proportion to its callers' calls (cProfile
    keeps one level of callers), so it points the way rather than counting exactly."""
    out: dict[str, float] = {}
    for (path, _, function), entry in stats.items():
        if function != "reschedule" or not path.endswith("trio/_core/_run.py"):
            continue
        for caller, figures in entry[4].items():
            woken = figures[0]
            above = stats.get(caller, (0, 0, 0, 0, {}))[4]
            total = sum(f[0] for f in above.values())
            if not total:
                out[_short(caller)] = out.get(_short(caller), 0.0) + woken
            for grand, grand_figures in above.items():
                label = f"{_short(caller)} <- {_short(grand)}"
                out[label] = out.get(label, 0.0) + woken * grand_figures[0] / total
    return out


def _is_function(label: str) -> bool:
    """Whether a counts label is one function's calls (``file:line(name)``)."""
    return ":" in label and not label.startswith("woken by ")


def _short(key: tuple[str, int, str]) -> str:
    """``folder/module.py:function`` of a profile key (``~`` for a C function)."""
    path, _, function = key
    return f"{'/'.join(path.split('/')[-2:])}:{function}"


async def _load(url: str, streams: int, tokens: int, requests: int | None = None) -> int:
    """``streams`` clients read ``tokens``-token streams, one each; with ``requests``,
    one client sends that many one-token JSON requests instead."""
    from benchmarks.harness import Server

    if requests is None:
        body = {**relay._body("/v1/chat/completions", "relay"), "max_tokens": tokens}
    else:
        body = relay._body("/v1/chat/completions", "relay", stream=False)
    server = Server("pool", url, None)  # type: ignore[arg-type]
    results = await closed_loop(
        server,
        1 if requests is not None else streams,
        requests or streams,
        lambda index: (body, {}),
        path="/v1/chat/completions",
        delta_mark=CHAT_DELTA_MARK,
    )
    bad = [r for r in results if r.error is not None or r.status != 200]
    assert not bad, bad[:1]
    return len(results) if requests is not None else sum(r.tokens for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=25, help="functions listed by calls")
    parser.add_argument("--checkout", type=Path, help="a folder holding another pool package")
    parser.add_argument("--ab", type=Path, help="time against the pool package in DIR")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--per-request", action="store_true", help="JSON requests, not tokens")
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    if args.ab is not None and args.per_request:
        trio.run(_timed_ab_json, args.ab, args.rounds, args.requests)
        return
    if args.ab is not None:
        trio.run(_timed_ab, args.ab, args.streams, args.tokens, args.rounds, args.seconds)
        return
    if args.per_request:
        _per_request(args.requests, args.checkout, args.top)
        return
    with zero_upstream() as upstream, tempfile.TemporaryDirectory() as folder:
        settings = _settings(Path(folder) / "settings.json", _relay_model(upstream.url))
        profile = Path(folder) / "pool.prof"
        # Two pools: the short streams' counts (start-up, requests, one token each) are
        # taken from the long streams', leaving what each further token costs.
        short = _run(settings, profile, args.checkout, args.streams, 1)
        long = _run(settings, profile, args.checkout, args.streams, args.tokens)
        tokens = long[1] - short[1]
        marginal = _marginal(short, long)
        for label in ("python calls", *_WATCH):
            print(f"{label:>16}: {marginal[label]:8.3f} per token")
        print(f"{'tokens':>16}: {tokens} (marginal)")
        functions = [(value, label) for label, value in marginal.items() if _is_function(label)]
        for value, label in sorted(functions, reverse=True)[: args.top]:
            print(f"{value:8.3f}  {label}")


def _per_request(requests: int, checkout: Path | None, top: int) -> None:
    """Marginal counts of one JSON request, the stub's and the pass-through's side by side."""
    with zero_upstream() as upstream, tempfile.TemporaryDirectory() as folder:
        profile = Path(folder) / "pool.prof"
        sides: dict[str, dict[str, object]] = {"stub": _STUB}
        sides["pass_through"] = _relay_model(upstream.url)
        marginal: dict[str, dict[str, float]] = {}
        for side, model in sides.items():
            settings = _settings(Path(folder) / f"{side}.json", model)
            few = _run(settings, profile, checkout, 1, 1, requests)
            many = _run(settings, profile, checkout, 1, 1, 10 * requests)
            marginal[side] = _marginal(few, many)
        by_package = {side: _by_package(figures) for side, figures in marginal.items()}
        print(f"{'per JSON request':>16}  {'stub':>10}  {'pass_through':>12}")
        for label in ("python calls", *_WATCH):
            stub, relayed = marginal["stub"][label], marginal["pass_through"][label]
            print(f"{label:>16}  {stub:10.2f}  {relayed:12.2f}")
        print("--- calls per request by where the function lives")
        relayed_by = by_package["pass_through"]
        for package in sorted(relayed_by, key=relayed_by.__getitem__, reverse=True):
            stub = by_package["stub"].get(package, 0.0)
            print(f"{package:>16}  {stub:10.2f}  {relayed_by[package]:12.2f}")
        for side, figures in marginal.items():
            print(f"--- {side}: task wake-ups per request by what woke the task")
            wakers = [(v, label) for label, v in figures.items() if label.startswith("woken by ")]
            for value, label in sorted(wakers, reverse=True):
                if value >= 0.05:
                    print(f"{value:8.2f}  {label.removeprefix('woken by ')}")
        for side, figures in marginal.items():
            print(f"--- {side}: functions by calls per request")
            functions = [(value, label) for label, value in figures.items() if _is_function(label)]
            for value, label in sorted(functions, reverse=True)[:top]:
                print(f"{value:8.2f}  {label}")


_STUB = {"backend": "stub", "enabled": True, "target_inflight": 256}


def _settings(path: Path, model: dict[str, object]) -> Path:
    """Write the settings of a pool serving ``model`` as ``relay``; returns ``path``."""
    service = {"log_level": "warning", "shutdown_grace_s": 1}
    engine = {"max_queue": 4096, "models": {"relay": model}}
    path.write_text(json.dumps({"service": service, "engine": engine}))
    return path


def _marginal(
    fewer: tuple[dict[str, float], int], more: tuple[dict[str, float], int]
) -> dict[str, float]:
    """What one more unit (token or request) counts: the difference of two runs'
    counts (as :func:`_run` returns them) divided by the units the second ran more."""
    extra = more[1] - fewer[1]
    return {label: (value - fewer[0].get(label, 0.0)) / extra for label, value in more[0].items()}


def _by_package(figures: dict[str, float]) -> dict[str, float]:
    """Calls summed by the package their function is in: a site-packages package by
    name, ``pool``, ``builtins`` (C functions) or ``stdlib`` (everything else)."""
    out: dict[str, float] = {}
    for label, value in figures.items():
        if not _is_function(label):
            continue
        path = label.split(":", 1)[0]
        if path == "~":
            package = "builtins"
        elif "site-packages/" in path:
            package = path.split("site-packages/", 1)[1].split("/", 1)[0]
        elif "/pool/" in path or path.startswith("pool/"):
            package = "pool"
        else:
            package = "stdlib"
        out[package] = out.get(package, 0.0) + value
    return out


def _relay_model(upstream_url: str) -> dict[str, object]:
    """The pool's model in front of the zero-work upstream, with room for every stream."""
    return {
        "backend": "openai_remote",
        "enabled": True,
        "remote_base_url": f"{upstream_url}/v1",
        "remote_model": "zero",
        "remote_timeout_s": 120,
        "target_inflight": 256,
    }


async def _timed_ab(other: Path, streams: int, tokens: int, rounds: int, seconds: float) -> None:
    from benchmarks.harness import pool_server

    body = {**relay._body("/v1/chat/completions", "relay"), "max_tokens": tokens}
    with ExitStack() as stack:
        upstream = stack.enter_context(zero_upstream())
        model = _relay_model(upstream.url)
        sides = {
            "this": stack.enter_context(pool_server({"relay": model}, name="this")),
            "other": stack.enter_context(
                pool_server({"relay": model}, name="other", checkout=other)
            ),
        }
        figures: dict[str, list[float]] = {name: [] for name in sides}
        print(f"load average before: {os.getloadavg()}")
        for round_index in range(rounds + 1):  # round 0 warms both up, uncounted
            for name, server in sides.items():
                cpu = server.cpu_seconds()
                results = await closed_loop(
                    server,
                    streams,
                    1_000_000,
                    lambda index: (body, {}),
                    max_s=seconds + 60,
                    path="/v1/chat/completions",
                    delta_mark=CHAT_DELTA_MARK,
                    stop_after_s=seconds if round_index else 0.5,
                )
                used = server.cpu_seconds() - cpu
                relayed = sum(r.tokens for r in results if r.error is None and r.status == 200)
                if round_index and relayed:
                    figures[name].append(used * 1000 / relayed)
                    print(f"round {round_index} {name}: {figures[name][-1]:.4f} ms per token")
        print(f"load average after: {os.getloadavg()}")
        for name, values in figures.items():
            print(f"{name}: median {statistics.median(values):.4f} ms of pool CPU per token")


async def _timed_ab_json(other: Path, rounds: int, requests: int) -> None:
    from benchmarks.harness import pool_server
    from benchmarks.pass_through import _cpu_set, default_pinning

    pools_cpus, upstream_cpus, client_cpus = default_pinning()
    body = relay._body("/v1/chat/completions", "relay", stream=False)
    client_before = os.sched_getaffinity(0)
    with ExitStack() as stack:
        upstream = stack.enter_context(zero_upstream(upstream_cpus or None))
        models = {"stub": _STUB, "pass_through": _relay_model(upstream.url)}
        pinned = pools_cpus or None
        sides = {
            (kind, name): stack.enter_context(
                pool_server(
                    {"relay": model},
                    name=f"{kind} {name}",
                    cpus=pinned,
                    checkout=None if name == "this" else other,
                )
            )
            for kind, model in models.items()
            for name in ("this", "other")
        }
        if client_cpus:
            os.sched_setaffinity(0, _cpu_set(client_cpus))
        cpu: dict[tuple[str, str], list[float]] = {side: [] for side in sides}
        p50: dict[tuple[str, str], list[float]] = {side: [] for side in sides}
        try:
            print(f"pinning: pools {pools_cpus}, upstream {upstream_cpus}, client {client_cpus}")
            print(f"load average before: {os.getloadavg()}")
            for round_index in range(rounds + 1):  # round 0 warms them up, uncounted
                order = list(sides.items())
                for side, server in order if round_index % 2 else order[::-1]:
                    used = server.cpu_seconds()
                    results = await closed_loop(
                        server,
                        1,
                        requests if round_index else 200,
                        lambda index: (body, {}),
                        path="/v1/chat/completions",
                        delta_mark=CHAT_DELTA_MARK,
                    )
                    used = server.cpu_seconds() - used
                    ok = [r.latency_ms for r in results if r.error is None and r.status == 200]
                    if round_index and ok:
                        cpu[side].append(used * 1000 / len(ok))
                        p50[side].append(statistics.median(ok))
                        print(
                            f"round {round_index} {server.name}: {cpu[side][-1]:.3f} ms"
                            f" of pool CPU a request, p50 {p50[side][-1]:.3f} ms"
                        )
        finally:
            os.sched_setaffinity(0, client_before)
        print(f"load average after: {os.getloadavg()}")
        for (kind, name), values in cpu.items():
            theirs = cpu[(kind, "other" if name == "this" else "this")]
            wins = sum(mine < their for mine, their in zip(values, theirs, strict=False))
            print(
                f"{kind} {name}: median {statistics.median(values):.3f} ms of pool CPU a"
                f" request, p50 {statistics.median(p50[(kind, name)]):.3f} ms; lower in"
                f" {wins} of {len(values)} rounds"
            )


def _run(
    settings: Path,
    profile: Path,
    checkout: Path | None,
    streams: int,
    tokens: int,
    requests: int | None = None,
) -> tuple[dict[str, float], int]:
    process = _serve(settings, profile, checkout)
    assert process.stdout is not None
    url = ""
    while not url:
        line = process.stdout.readline().decode()
        if not line:
            raise SystemExit("the pool exited before listening")
        if "listening on " in line:
            url = line.split("listening on ")[1].strip()
    try:
        relayed = trio.run(_load, url, streams, tokens, requests)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    return counts(profile, 1), relayed


if __name__ == "__main__":
    main()
