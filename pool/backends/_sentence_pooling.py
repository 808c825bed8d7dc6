"""How a sentence-transformers model turns token vectors into one vector per text.

An encoder (BERT and kin) hands back a vector per token; the model's own checkout says
what makes a sentence embedding of them: ``modules.json`` lists the modules in order
(the transformer, a ``Pooling`` whose folder holds ``config.json``, often a
``Normalize``), and ``sentence_bert_config.json`` the longest input it was trained on.
:func:`read_sentence_config` reads those files and :func:`pool_and_normalize` applies
them, so the pool's vectors are the ones sentence-transformers would give. A module the
pool cannot apply (a ``Dense`` projection, say) is refused at load, never skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pool.errors import BackendError

if TYPE_CHECKING:  # numpy is the ct2 extra's, imported where vectors are pooled
    import numpy as np
    import numpy.typing as npt

    Vectors = npt.NDArray[np.float32]

PoolingMode = Literal["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]
# The legacy boolean keys of 1_Pooling/config.json, in the order sentence-transformers
# concatenates the vectors of several modes.
_LEGACY_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODES: dict[str, PoolingMode] = {mode: mode for mode in _LEGACY_KEYS.values()}
# BERT's position table; the bound of a checkout that names no max_seq_length.
_DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True, slots=True)
class SentenceConfig:
    """What a sentence-transformers checkout says about its embeddings."""

    modes: tuple[PoolingMode, ...]
    normalize: bool
    max_tokens: int


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackendError(f"cannot read {path}: {exc}") from exc


def _pooling_modes(config: Any, path: Path) -> tuple[PoolingMode, ...]:
    if not isinstance(config, dict):
        raise BackendError(f"{path} is not a JSON object")
    named = config.get("pooling_mode")
    if named is not None:  # sentence-transformers 5's form: one mode or a list
        modes = named if isinstance(named, list) else [named]
    else:
        modes = [mode for key, mode in _LEGACY_KEYS.items() if config.get(key)]
    unknown = [m for m in modes if not isinstance(m, str) or m not in _MODES]
    if unknown or not modes:
        raise BackendError(
            f"{path} names no pooling the pool knows ({unknown or 'none'});"
            f" known: {', '.join(sorted(_MODES))}"
        )
    if config.get("include_prompt") is False:
        raise BackendError(f"{path}: pooling without the prompt tokens is not supported")
    return tuple(_MODES[m] for m in modes)


def read_sentence_config(folder: Path) -> SentenceConfig:
    """The pooling, normalisation and input bound ``folder``'s files declare.

    Raises:
        BackendError: ``modules.json`` is missing, names a module other than the
            transformer, ``Pooling`` and ``Normalize``, or its pooling is unknown.
    """
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        raise BackendError(
            f"{folder} has no modules.json: the pool pools and normalizes an encoder's"
            " vectors as its sentence-transformers config says"
            " (build the folder with `llm-pool convert encoder`)"
        )
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise BackendError(f"{modules_path} is not a JSON list of modules")
    modes: tuple[PoolingMode, ...] | None = None
    normalize = False
    for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling_path = folder / str(module.get("path", "")) / "config.json"
            modes = _pooling_modes(_read_json(pooling_path), pooling_path)
        elif kind == "Normalize":
            normalize = True
        else:
            raise BackendError(
                f"{modules_path} has a {kind or 'nameless'} module; the pool applies only"
                " Transformer, Pooling and Normalize"
            )
    if modes is None:
        raise BackendError(f"{modules_path} has no Pooling module")
    return SentenceConfig(modes, normalize, _max_tokens(folder))


def _max_tokens(folder: Path) -> int:
    """The longest input in tokens: sentence-transformers' ``max_seq_length``, else the
    tokenizer's ``model_max_length`` (which some checkouts set to a huge sentinel)."""
    for name, key in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        if (folder / name).is_file():
            value = _read_json(folder / name).get(key)
            if isinstance(value, int) and 0 < value <= 1_000_000:
                return value
    return _DEFAULT_MAX_TOKENS


def pool_and_normalize(hidden: Vectors, lengths: list[int], config: SentenceConfig) -> Vectors:
    """One vector per text from ``hidden`` (texts x tokens x width, each text's tokens
    first, then padding up to the longest): each of ``config.modes`` in turn,
    concatenated, then scaled to unit length when the model normalizes."""
    import numpy as np

    count = len(lengths)
    mask = np.arange(hidden.shape[1])[None, :] < np.asarray(lengths)[:, None]
    weights = mask.astype(np.float32)[:, :, None]
    sizes = np.asarray(lengths, dtype=np.float32)[:, None]
    parts: list[Vectors] = []
    for mode in config.modes:
        if mode == "cls":
            parts.append(hidden[:, 0, :])
        elif mode == "max":
            parts.append(np.where(mask[:, :, None], hidden, -np.inf).max(axis=1))
        elif mode == "mean":
            parts.append((hidden * weights).sum(axis=1) / sizes)
        elif mode == "mean_sqrt_len_tokens":
            parts.append((hidden * weights).sum(axis=1) / np.sqrt(sizes))
        elif mode == "weightedmean":
            # Later tokens weigh more: position i (from 1) counts i times.
            positional = (
                weights * np.arange(1, hidden.shape[1] + 1, dtype=np.float32)[None, :, None]
            )
            parts.append((hidden * positional).sum(axis=1) / positional.sum(axis=1))
        else:  # lasttoken
            parts.append(hidden[np.arange(count), np.asarray(lengths) - 1, :])
    pooled = np.concatenate(parts, axis=1).astype(np.float32).reshape(count, -1)
    if config.normalize:
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        pooled = pooled / np.maximum(norms, 1e-12)
    return pooled
