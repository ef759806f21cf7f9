"""A tiny Qwen2 chat model for the word-problem task: character tokenizer over printable ASCII with a
ChatML template, random init, then a short supervised warm-up on worked solutions so it answers
in the \\boxed{} format before RL starts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from rlmesh.models.tokenizer import EOS_TOKEN, IM_END_TOKEN, PAD_TOKEN, build_text_tokenizer, save_chat_tokenizer
from rlmesh.tasks.word_problems import WordProblemSource, messages_for, solution_text

log = structlog.get_logger()

WARMUP_SEED = 7_000_001
"""Seeds the warm-up's problems; they come from a WordProblemSource, so never from the held-out set."""


@dataclass(frozen=True, slots=True)
class ChatModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 384
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    max_positions: int = 512
    seed: int = 0
    warmup_iterations: int = 60
    warmup_batch: int = 16
    warmup_lr: float = 6e-3


def create_chat_model(directory: str | Path, spec: ChatModelSpec = ChatModelSpec()) -> Path:
    """Writes config, safetensors and the chat tokenizer to `directory` after the supervised warm-up."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_text_tokenizer()
    save_chat_tokenizer(tokenizer, directory, model_max_length=spec.max_positions)
    eos_id = tokenizer.token_to_id(IM_END_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).float()
    # The warm-up renders prompts with the saved tokenizer's own chat template: exactly what the
    # task's renderer will feed the model during RL.
    _supervised_warmup(model, AutoTokenizer.from_pretrained(str(directory)), spec, eos_id, pad_id)
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _supervised_warmup(model, tokenizer, spec: ChatModelSpec, eos_id: int, pad_id: int) -> None:
    source = WordProblemSource(WARMUP_SEED + spec.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.warmup_lr)
    started = time.monotonic()
    model.train()
    for iteration in range(spec.warmup_iterations):
        rows, masks = [], []
        for index in range(spec.warmup_batch):
            problem = source.problem_at(iteration * spec.warmup_batch + index)
            prompt_text = tokenizer.apply_chat_template(list(messages_for(problem)), add_generation_prompt=True, tokenize=False)
            prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
            answer = tokenizer.encode(solution_text(problem), add_special_tokens=False) + [eos_id]
            rows.append(prompt + answer)
            masks.append([0] * len(prompt) + [1] * len(answer))
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        token_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none"
        ).view(ids.size(0), -1)
        loss = (token_loss * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if iteration % 10 == 0 or iteration == spec.warmup_iterations - 1:
            log.info("chat warm-up", iteration=iteration, loss=round(loss.item(), 4),
                     seconds=round(time.monotonic() - started, 1))
    model.eval()


def is_model_dir(directory: str | Path) -> bool:
    directory = Path(directory)
    return all((directory / name).is_file()
               for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))
