"""A tiny random-weight llama and a byte-level BPE tokenizer, made locally.

Nothing is downloaded: the tokenizer is trained on a few sentences with
``tokenizers`` and the weights are random. The shapes are the smallest the CPU
attention backend serves (head size 64).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CORPUS = [
    "The KV cache stores keys and values of past tokens so decoding does not recompute them.",
    "vLLM allocates the KV cache in fixed-size blocks and shares prefix blocks between requests.",
    "When the pool runs dry the scheduler preempts requests and recomputes them later.",
    "A flat memory line in nvidia-smi says nothing about the blocks inside the pool.",
    "OpenTelemetry carries traces and metrics to the collector, Jaeger, Tempo and Prometheus.",
    "You are a helpful assistant. Answer briefly and precisely, and say when you are unsure.",
    "What is the capital of France? Paris. What is two plus two? Four. Tell me a story.",
]

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def make_tiny_model(directory: str | os.PathLike, vocab_size: int = 512) -> Path:
    """Writes the model into ``directory`` (once) and returns its path."""
    path = Path(directory)
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)

    config = LlamaConfig(
        **{k: v for k, v in LLAMA_CONFIG.items() if k not in ("architectures", "model_type")},
        vocab_size=len(fast),
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    with open(path / "config.json") as f:
        saved = json.load(f)
    assert saved["architectures"] == ["LlamaForCausalLM"]
    return path


if __name__ == "__main__":
    import sys

    print(make_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "out/tiny-llama"))
