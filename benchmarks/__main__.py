"""``python -m benchmarks run SCENARIO [--quick]``: run one scenario and write its results."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

from benchmarks._machine import describe
from benchmarks.pass_through import UPSTREAMS
from benchmarks.scenarios import SCENARIOS
from benchmarks.soak_faults import soak_faults


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])

    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _throughput_series(
    rows: list[dict[str, Any]],
) -> tuple[dict[str, dict[str, list[tuple[int, float]]]], str]:
    """Throughput against concurrency per side, from rows keyed ``"MODE c=N"`` with
    ``SIDE_rps`` columns or keyed ``concurrency`` with ``SIDE_tokens_per_s`` columns."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    unit = ""
    for row in rows:
        if " c=" in str(row.get("cell", "")):
            mode, concurrency = row["cell"].split(" c=")
            suffix, unit = "_rps", "requests/s"
        elif "concurrency" in row:
            mode, concurrency = "", row["concurrency"]
            suffix, unit = "_tokens_per_s", "tokens/s"
        else:
            continue
        for key, value in row.items():
            if key.endswith(suffix) and isinstance(value, int | float):
                side = key.removesuffix(suffix)
                series.setdefault(mode, {}).setdefault(side, []).append((int(concurrency), value))
    return series, unit


def _plots(name: str, report: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    if "cdf" in report:
        fig, axes = plt.subplots(1, len(report["cdf"]), figsize=(4 * len(report["cdf"]), 3.5))
        for ax, (key, sides) in zip(
            list(getattr(axes, "flat", [axes])), report["cdf"].items(), strict=False
        ):
            for side, values in sides.items():
                if values:
                    ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=side)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("latency (ms)")
            ax.set_xscale("log")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "latency_cdf.png", dpi=90)
        files.append("latency_cdf.png")
    if name == "soak":
        files.append(_soak_plot(report, out, plt))
        plt.close("all")
        return files
    if name == "soak-faults":
        files.append(_soak_faults_plot(report, out, plt))
        plt.close("all")
        return files
    series, unit = _throughput_series(report["rows"])
    if series:
        fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.5))
        for ax, (mode, sides) in zip(
            list(getattr(axes, "flat", [axes])), series.items(), strict=True
        ):
            for side, points in sides.items():
                ax.plot(*zip(*sorted(points), strict=True), marker="o", label=side)
            ax.set_title(mode or name, fontsize=9)
            ax.set_xlabel("concurrent clients")
            ax.set_xscale("log", base=2)
            ax.set_ylabel(unit)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=90)
        files.append("throughput.png")
    if name == "warm-conversations":
        files.append(_evaluated_plot(report["rows"], out, plt))
    if name == "replicas":
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for model in dict.fromkeys(r["model"] for r in report["rows"]):
            rows = [r for r in report["rows"] if r["model"] == model]
            counts = [r["replicas"] for r in rows]
            ax.plot(counts, [r["speedup"] for r in rows], marker="o", label=model)
        ax.plot(counts, counts, linestyle="--", color="grey", label="ideal")
        ax.set_xlabel("replicas")
        ax.set_ylabel("speedup over one replica")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=90)
        files.append("throughput.png")
    plt.close("all")
    return files


def _evaluated_plot(rows: list[dict[str, Any]], out: Path, plt: Any) -> str:
    """Prompt tokens evaluated against those sent, per side, one panel per part."""
    parts = list(dict.fromkeys(row["part"] for row in rows))
    fig, axes = plt.subplots(1, len(parts), figsize=(4.5 * len(parts), 3.5))
    for ax, part in zip(list(getattr(axes, "flat", [axes])), parts, strict=True):
        mine = [row for row in rows if row["part"] == part]
        sides = [row["side"] for row in mine]
        ax.bar(sides, [row["prompt_tokens"] for row in mine], color="lightgrey", label="sent")
        ax.bar(sides, [row["evaluated_tokens"] for row in mine], label="evaluated")
        ax.set_title(part, fontsize=9)
        ax.set_ylabel("prompt tokens")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "prompt_tokens.png", dpi=90)
    return "prompt_tokens.png"


def _soak_plot(report: dict[str, Any], out: Path, plt: Any) -> str:
    samples = report["series"]
    fits = {row["series"]: row for row in report["rows"]}
    keys = [("rss_mib", "RSS (MiB)"), ("fds", "open fds"), ("trio_tasks", "Trio tasks"),
            ("threads", "threads")]  # fmt: skip
    fig, axes = plt.subplots(1, len(keys), figsize=(16, 3.5))
    times = [s["t_s"] for s in samples]
    for ax, (key, label) in zip(axes, keys, strict=True):
        ax.plot(times, [s[key] for s in samples], marker=".", linewidth=1)
        row = fits[key]
        ax.set_title(f"{label}: {row['slope_per_hour']:+g}/h", fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=90)
    return "soak.png"


def _soak_faults_plot(report: dict[str, Any], out: Path, plt: Any) -> str:
    """RSS, fds, threads and Trio tasks of both pools over the run, the fault windows
    shaded and named."""
    samples = report["series"]
    windows = report.get("windows", [])
    keys = [("rss_mib", "RSS (MiB)"), ("fds", "open fds"), ("trio_tasks", "Trio tasks"),
            ("threads", "threads")]  # fmt: skip
    fig, axes = plt.subplots(len(keys), 1, figsize=(12, 2.4 * len(keys)), sharex=True)
    times = [s["t_s"] for s in samples]
    for ax, (key, label) in zip(axes, keys, strict=True):
        for side in ("a", "b"):
            ax.plot(
                times,
                [s[f"{side}_{key}"] for s in samples],
                linewidth=1,
                label=f"pool {side.upper()}",
            )
        for window in windows:
            ax.axvspan(window["inject_at"], window["end"], color="orange", alpha=0.2)
        ax.set_ylabel(label, fontsize=8)
        ax.set_ylim(bottom=0)
    for window in windows:
        axes[0].text(window["inject_at"], axes[0].get_ylim()[1] * 0.9, window["name"], fontsize=7)
    axes[0].legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out / "soak_faults.png", dpi=90)
    return "soak_faults.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run")
    run.add_argument("scenario", choices=sorted(SCENARIOS))
    run.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    run.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    run.add_argument(
        "--llama-threads",
        type=int,
        help="llama-server: compute threads (-t) of the servers; results go to llama-server-tN",
    )
    run.add_argument(
        "--baseline",
        type=Path,
        help="overhead-stub: another checkout of the pool served beside this one, interleaved;"
        " results go to overhead-stub-vs-baseline",
    )
    run.add_argument(
        "--no-litellm",
        action="store_true",
        help="pass-through: leave LiteLLM out (it needs its own environment, built once)",
    )
    run.add_argument(
        "--pin",
        metavar="PROXIES:UPSTREAM:CLIENT",
        help="pass-through: the CPUs (taskset lists) of the proxies under test, of the"
        " upstream and of the client (default: one core each, or with two cores the"
        " proxies on the first, the upstream and the client on the second)",
    )
    run.add_argument(
        "--upstream",
        choices=UPSTREAMS,
        default="zero",
        help="pass-through: the upstream (benchmarks/pass_through.py); stub-pool's results"
        " go to pass-through/stub-pool-upstream",
    )
    run.add_argument(
        "--minutes",
        type=float,
        help="soak: length of the run with faults (default 60, --quick 5; each fault once"
        " per 10 minutes, every fault at least once); results go to soak-faults",
    )
    run.add_argument(
        "--no-faults",
        action="store_true",
        help="soak: the fault-free leak soak (10 minutes, --quick 1); results go to soak",
    )
    plot = commands.add_parser("plot", help="draw a run's plots again from its results.json")
    plot.add_argument("folder", type=Path, help="e.g. benchmarks/results/soak")
    args = parser.parse_args(argv)
    if args.command == "plot":
        return _replot(args.folder)
    machine = describe()
    started = time.time()
    scenario = SCENARIOS[args.scenario]
    name, command = args.scenario, f"python -m benchmarks run {args.scenario}"
    if args.llama_threads and args.scenario == "llama-server":
        scenario = partial(scenario, threads=args.llama_threads)
        name += f"-t{args.llama_threads}"
        command += f" --llama-threads {args.llama_threads}"
    if args.baseline and args.scenario == "overhead-stub":
        scenario = partial(scenario, baseline=args.baseline.resolve())
        name += "-vs-baseline"
        command += f" --baseline {args.baseline}"
    if args.scenario == "pass-through":
        pin = tuple(args.pin.split(":")) if args.pin else None
        if pin is not None and len(pin) != 3:
            parser.error("--pin takes PROXIES:UPSTREAM:CLIENT")
        scenario = partial(
            scenario, litellm=not args.no_litellm, pin=pin, upstream_kind=args.upstream
        )
        command += " --no-litellm" if args.no_litellm else ""
        command += f" --pin {args.pin}" if args.pin else ""
        if args.upstream != "zero":
            name += f"/{args.upstream}-upstream"
            command += f" --upstream {args.upstream}"
    if args.minutes is None:
        args.minutes = 5.0 if args.quick else 60.0
    if args.scenario == "soak" and not args.no_faults:
        scenario = partial(soak_faults, args.minutes)
        name = "soak-faults"
        command += f" --minutes {args.minutes:g}"
        report = trio.run(scenario)
    else:
        command += " --no-faults" if args.scenario == "soak" else ""
        command += " --quick" if args.quick else ""
        report = trio.run(scenario, args.quick)
    failures = report.pop("failures", None)
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    raw = report.pop("raw")
    files = _plots("soak-faults" if name == "soak-faults" else args.scenario, report, out)
    extra_tables = {
        key: value
        for key, value in report.items()
        if key not in ("rows", "series")
        and isinstance(value, list)
        and value
        and isinstance(value[0], dict)
    }
    if files:
        report.pop("cdf", None)  # drawn; the raw summaries keep what matters
    # else kept, so `python -m benchmarks plot` can draw it where matplotlib is installed
    full = {
        "scenario": name,
        "command": command,
        "machine": machine,
        "started_at": started,
        "duration_s": time.time() - started,
        **report,
        "raw": _strip(raw),
    }
    (out / "results.json").write_text(json.dumps(full, indent=2))
    (out / "results.md").write_text(
        f"# {name}\n\nCommand: `{command}`  \n"
        f"Machine: {machine['cpu']}, {machine['cores']} cores,"
        f" load average at start {machine['loadavg_at_start']}; took {full['duration_s']:.0f} s"
        + _versions(report.get("versions"))
        + "\n\n"
        + _table(report["rows"])
        + "".join(f"\n## {key}\n\n{_table(rows)}" for key, rows in extra_tables.items())
        + "".join(f"\n![{f}]({f})\n" for f in files)
    )
    print(_table(report["rows"]))
    for key, rows in extra_tables.items():
        print(f"{key}:\n{_table(rows)}")
    if failures is not None:
        # The fault soak's expectations (docs/reliability.md): each one that failed.
        text = (out / "results.md").read_text()
        if args.minutes < 60:
            text = text.replace(
                f"# {name}\n",
                f"# {name}\n\n**A short shake-out run ({args.minutes:g} minutes), not the"
                " 60-minute run of issue #45.**\n",
                1,
            )
        (out / "results.md").write_text(
            text
            + "\n## Expectations that failed\n\n"
            + ("".join(f"- {f}\n" for f in failures) or "none\n")
        )
        (out / "results.json").write_text(json.dumps({**full, "failures": failures}, indent=2))
        for failure in failures:
            print(f"FAILED: {failure}", file=sys.stderr)
        return 1 if failures else 0
    return 0


def _versions(versions: dict[str, str | None] | None) -> str:
    """The results.md line naming the versions a run recorded (LiteLLM's for proxy-peers)."""
    if not versions:
        return ""
    named = ", ".join(f"{name} {version or 'unknown'}" for name, version in versions.items())
    return f"  \nVersions: {named}"


def _replot(folder: Path) -> int:
    """Plots of a finished run (a machine without matplotlib wrote only the tables)."""
    report = json.loads((folder / "results.json").read_text())
    scenario = re.sub(r"-t\d+$", "", report["scenario"])  # llama-server-t1: llama-server
    files = _plots(scenario, report, folder)
    if not files:
        print("matplotlib is not installed (pip install 'llm-pool[bench]')", file=sys.stderr)
        return 1
    markdown = folder / "results.md"
    text = markdown.read_text()
    text += "".join(f"\n![{f}]({f})\n" for f in files if f"({f})" not in text)
    markdown.write_text(text)
    print("\n".join(str(folder / f) for f in files))
    return 0


def _strip(raw: Any) -> Any:
    """Drop the per-request latency lists from the raw summaries (the CDF plot has them)."""
    if isinstance(raw, dict):
        return {k: _strip(v) for k, v in raw.items() if k != "latencies_ms"}
    if isinstance(raw, list):
        return [_strip(v) for v in raw]
    return raw


if __name__ == "__main__":
    sys.exit(main())
