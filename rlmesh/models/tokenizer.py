"""A character tokenizer built as a byte-level BPE with no merges: one token per character,
identical ids in `tokenizers`, `AutoTokenizer` and vLLM (a WordLevel model is rewritten by
AutoTokenizer for qwen2). The vocabulary is the task's alphabet, so the model's softmax
spends no mass on characters the task never uses."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
DEFAULT_ALPHABET = "0123456789="


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> Tokenizer:
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    symbols = []
    for char in alphabet:
        encoded = char.encode()
        if len(encoded) != 1 or char not in byte_symbols:
            raise ValueError(f"alphabet character {char!r} is not a printable single byte")
        symbols.append(char)
    if len(set(symbols)) != len(symbols):
        raise ValueError("alphabet has repeated characters")
    vocab = {symbol: index for index, symbol in enumerate(symbols)}
    vocab[UNK_TOKEN] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([UNK_TOKEN, EOS_TOKEN, PAD_TOKEN])
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
                "unk_token": UNK_TOKEN,
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
