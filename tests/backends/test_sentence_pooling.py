"""Reading a sentence-transformers config and pooling token vectors as it says.

Hand-made token vectors with known answers; the real model is test_ct2_encoder.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pool.backends import SentenceConfig, read_sentence_config
from pool.backends._sentence_pooling import pool_and_normalize
from pool.errors import BackendError

# Two texts of 3 and 2 tokens, width 2; the second's third position is padding, which
# holds a huge value so that counting it shows in every mode.
HIDDEN = np.array(
    [
        [[1.0, 0.0], [3.0, 2.0], [2.0, 4.0]],
        [[0.0, 2.0], [4.0, 0.0], [100.0, 100.0]],
    ],
    dtype=np.float32,
)
LENGTHS = [3, 2]


def _pool(*modes: Any, normalize: bool = False) -> list[list[float]]:
    pooled = pool_and_normalize(HIDDEN, LENGTHS, SentenceConfig(modes, normalize, 256))
    return [[round(float(x), 4) for x in row] for row in pooled]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("cls", [[1.0, 0.0], [0.0, 2.0]]),
        ("max", [[3.0, 4.0], [4.0, 2.0]]),
        ("mean", [[2.0, 2.0], [2.0, 1.0]]),
        ("mean_sqrt_len_tokens", [[6 / 3**0.5, 6 / 3**0.5], [4 / 2**0.5, 2 / 2**0.5]]),
        # Weights 1, 2, 3 by position: (1*1 + 2*3 + 3*2) / 6 and (2*2 + 3*4) / 6.
        ("weightedmean", [[13 / 6, 16 / 6], [8 / 3, 2 / 3]]),
        ("lasttoken", [[2.0, 4.0], [4.0, 0.0]]),
    ],
)
def test_each_pooling_mode_skips_the_padding(mode: str, expected: list[list[float]]) -> None:
    assert _pool(mode) == [[round(x, 4) for x in row] for row in expected]


def test_modes_concatenate_in_order_and_normalize_scales_to_unit_length() -> None:
    assert _pool("cls", "mean") == [[1.0, 0.0, 2.0, 2.0], [0.0, 2.0, 2.0, 1.0]]
    unit = _pool("mean", normalize=True)
    assert unit == [[0.7071, 0.7071], [0.8944, 0.4472]]


def _checkout(tmp_path: Path, modules: list[dict[str, Any]], pooling: dict[str, Any]) -> Path:
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir(exist_ok=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


TRANSFORMER = {
    "idx": 0,
    "name": "0",
    "path": "",
    "type": "sentence_transformers.models.Transformer",
}
POOLING = {
    "idx": 1,
    "name": "1",
    "path": "1_Pooling",
    "type": "sentence_transformers.models.Pooling",
}
NORMALIZE = {
    "idx": 2,
    "name": "2",
    "path": "2_Normalize",
    "type": "sentence_transformers.models.Normalize",
}


def test_the_legacy_and_the_current_pooling_config_are_read(tmp_path: Path) -> None:
    legacy = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    folder = _checkout(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], legacy)
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    assert read_sentence_config(folder) == SentenceConfig(("mean",), True, 128)
    # sentence-transformers 5 writes one `pooling_mode` (a name or a list); no Normalize.
    folder = _checkout(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode": ["cls", "max"]})
    (folder / "sentence_bert_config.json").unlink()
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    assert read_sentence_config(folder) == SentenceConfig(("cls", "max"), False, 512)


@pytest.mark.parametrize(
    ("modules", "pooling", "message"),
    [
        ([TRANSFORMER, POOLING], {"pooling_mode": "median"}, "no pooling the pool knows"),
        ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": False}, "no pooling the pool knows"),
        ([TRANSFORMER], {"pooling_mode": "mean"}, "no Pooling module"),
        (
            [TRANSFORMER, POOLING, {"idx": 2, "path": "2_Dense", "type": "x.Dense"}],
            {"pooling_mode": "mean"},
            "a Dense module",
        ),
        (
            [TRANSFORMER, POOLING],
            {"pooling_mode": "mean", "include_prompt": False},
            "without the prompt",
        ),
    ],
)
def test_what_the_pool_cannot_apply_is_refused(
    tmp_path: Path, modules: list[dict[str, Any]], pooling: dict[str, Any], message: str
) -> None:
    with pytest.raises(BackendError, match=message):
        read_sentence_config(_checkout(tmp_path, modules, pooling))


def test_a_folder_without_modules_json_is_refused_naming_the_converter(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="llm-pool convert encoder"):
        read_sentence_config(tmp_path)
