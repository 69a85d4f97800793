"""A tiny byte-level BPE tokenizer with a chat template, to pair with the tiny test models.

Byte-level, so any text (emoji included) round-trips and multi-byte characters
span several tokens — what incremental detokenization must handle.
"""

from __future__ import annotations

import os
from pathlib import Path

# Matches TINY_LLAMA_CONFIG: pad 0, bos 1, eos 2, vocab 512.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "Once upon a time there was a small model that served many requests at once.",
    "<|system|>You are a helpful assistant.\n<|user|>What is the capital of France?\n<|assistant|>",
    "naïve café, über, señor, 東京, 😀 emoji and numbers 0123456789",
]


def make_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 512) -> str:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens and save it (HF format) into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    # Fill the id space up to the model's vocab so every id a random model samples decodes to something.
    wrapped.add_tokens([f"<x{i}>" for i in range(len(wrapped), vocab_size)])
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out)
    return str(out)


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of ``question`` as one user turn through the tokenizer's chat template, ready to generate."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text)
