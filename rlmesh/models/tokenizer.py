"""A byte-level BPE tokenizer with no merges: one token per byte, identical in `tokenizers`,
`AutoTokenizer` and vLLM, so every engine sees the same ids."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def build_byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
                "model_max_length": 64,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    return Tokenizer.from_file(str(path))
