"""A tiny Qwen2 chat model for the word-problem tasks: character tokenizer over printable ASCII with a
ChatML template, random init, then a short supervised warm-up on worked solutions, answered directly
or with one calculator call, so it answers in the \\boxed{} format and knows the tool-call format
before RL starts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from rlmesh.models.qwen2_tiny import supervised_step, tiny_qwen2_config
from rlmesh.models.tokenizer import EOS_TOKEN, IM_END_TOKEN, PAD_TOKEN, build_text_tokenizer, save_chat_tokenizer
from rlmesh.environments.calculator import worked_turns
from rlmesh.tasks.word_problems import WordProblemSource, expression_of, messages_for, solution_text

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
    tool_share: float = 0.5
    """Share of the warm-up's problems solved with a calculator call (the `calculator` environment's
    transcript) rather than directly."""


def create_chat_model(directory: str | Path, spec: ChatModelSpec = ChatModelSpec()) -> Path:
    """Writes config, safetensors and the chat tokenizer to `directory` after the supervised warm-up."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_text_tokenizer()
    save_chat_tokenizer(tokenizer, directory, model_max_length=spec.max_positions)
    eos_id = tokenizer.token_to_id(IM_END_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    config = tiny_qwen2_config(spec, tokenizer.get_vocab_size(), bos_id=tokenizer.token_to_id(EOS_TOKEN), eos_id=eos_id,
                               pad_id=pad_id)
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
        pairs = []
        for index in range(spec.warmup_batch):
            position = iteration * spec.warmup_batch + index
            problem = source.problem_at(position)
            if (position * 0.6180339887) % 1 < spec.tool_share:
                pairs += _tool_pairs(tokenizer, problem, eos_id)
                continue
            prompt_text = tokenizer.apply_chat_template(list(messages_for(problem)), add_generation_prompt=True, tokenize=False)
            pairs.append((tokenizer.encode(prompt_text, add_special_tokens=False),
                          tokenizer.encode(solution_text(problem), add_special_tokens=False) + [eos_id]))
        loss = supervised_step(model, optimizer, pairs, pad_id)
        if iteration % 10 == 0 or iteration == spec.warmup_iterations - 1:
            log.info("chat warm-up", iteration=iteration, loss=round(loss, 4),
                     seconds=round(time.monotonic() - started, 1))
    model.eval()


def _tool_pairs(tokenizer, problem, eos_id: int) -> list[tuple[list[int], list[int]]]:
    """The two assistant turns of a calculator episode, each after its whole context as the episode
    renders it: the tool call, then the boxed answer after the tool's result."""
    turns = worked_turns(problem.text, expression_of(problem), problem.answer)
    pairs = []
    for end in (2, 4):
        context = tokenizer.apply_chat_template(turns[:end], add_generation_prompt=True, tokenize=False)
        pairs.append((tokenizer.encode(context, add_special_tokens=False),
                      tokenizer.encode(turns[end]["content"], add_special_tokens=False) + [eos_id]))
    return pairs
