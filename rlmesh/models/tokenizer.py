"""A character tokenizer built as a byte-level BPE with no merges: one token per character,
identical ids in `tokenizers`, `AutoTokenizer` and vLLM (a WordLevel model is rewritten by
AutoTokenizer for qwen2). The vocabulary is the task's alphabet, so the model's softmax
spends no mass on characters the task never uses."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

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
    return _character_tokenizer({symbol: index for index, symbol in enumerate(symbols)}, [EOS_TOKEN, PAD_TOKEN])


def _character_tokenizer(vocab: dict[str, int], special_tokens: list[str]) -> Tokenizer:
    """A byte-level BPE without merges over `vocab` (one token per character), then the unknown
    token and `special_tokens`."""
    tokenizer = Tokenizer(models.BPE(vocab={**vocab, UNK_TOKEN: len(vocab)}, merges=[], unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([UNK_TOKEN, *special_tokens])
    return tokenizer


def save_tokenizer(
    tokenizer: Tokenizer,
    directory: Path,
    eos_token: str = EOS_TOKEN,
    model_max_length: int = 64,
    chat_template: str | None = None,
) -> None:
    """tokenizer.json and the tokenizer_config.json that AutoTokenizer reads with it."""
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
"""ChatML's turn markers; `<|im_end|>` ends a turn, so it is a chat model's EOS."""
TEXT_ALPHABET = "".join(chr(code) for code in range(0x20, 0x7F)) + "\n"
"""Printable ASCII and newline: enough for English prompts and short worked solutions."""
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
"""The Hermes / Qwen tool-call markers."""
CHATML_TEMPLATE = (
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_text_tokenizer(alphabet: str = TEXT_ALPHABET) -> Tokenizer:
    """One token per character of `alphabet`, spaces and newlines included, plus the ChatML special
    tokens. Each character is stored as the symbol the ByteLevel pre-tokenizer turns it into (a
    space becomes "Ġ"), so `tokenizers` and `AutoTokenizer` give the same ids."""
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab: dict[str, int] = {}
    for char in alphabet:
        if len(char.encode()) != 1:
            raise ValueError(f"alphabet character {char!r} is not a single byte")
        symbol = pre_tokenizer.pre_tokenize_str(char)[0][0]
        if symbol in vocab:
            raise ValueError(f"alphabet has {char!r} more than once")
        vocab[symbol] = len(vocab)
    tokenizer = _character_tokenizer(vocab, [EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN])
    # As in Qwen2.5's tokenizer: one token each, not special, so a decoded turn keeps them.
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_CALL_TAGS])
    return tokenizer


def save_chat_tokenizer(tokenizer: Tokenizer, directory: Path, model_max_length: int) -> None:
    """Writes a `build_text_tokenizer` tokenizer with the ChatML template in tokenizer_config.json, so
    `AutoTokenizer(...).apply_chat_template` renders prompts and `<|im_end|>` is its EOS."""
    save_tokenizer(tokenizer, directory, IM_END_TOKEN, model_max_length, CHATML_TEMPLATE)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    return Tokenizer.from_file(str(path))


def load_hf_tokenizer(directory: str | Path):
    """A model folder's tokenizer as `transformers` loads it (chat template included)."""
    from transformers import AutoTokenizer

    if not (Path(directory) / "tokenizer.json").is_file() and not (Path(directory) / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{directory} holds no tokenizer (tokenizer.json or tokenizer_config.json)")
    return AutoTokenizer.from_pretrained(str(directory))


def stop_token_ids(model_config, tokenizer) -> list[int]:
    """Tokens that end a response: the model's EOS ids (one or several) and the tokenizer's."""
    ids: list[int] = []
    for source in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for token in source if isinstance(source, list) else [source]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError("the model names no EOS token (config.eos_token_id) and neither does its tokenizer")
    return ids
