"""A tiny Qwen2 chat model for the word-problem tasks: character tokenizer over printable ASCII with a
ChatML template, random init, then a supervised warm-up on worked solutions, answered directly
or with one calculator call, so it answers in the \\boxed{} format and calls the tool before RL starts."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from rlmesh.environments.calculator import worked_turns
from rlmesh.models.qwen2_tiny import Example, answer_example, supervised_step, tiny_qwen2_config
from rlmesh.models.tokenizer import EOS_TOKEN, IM_END_TOKEN, PAD_TOKEN, build_text_tokenizer, save_chat_tokenizer
from rlmesh.tasks.word_problems import WordProblemSource, expression_of, messages_for, solution_text

log = structlog.get_logger()

WARMUP_SEED = 7_000_001
"""Seeds the warm-up's problems; they come from a WordProblemSource, so never from the held-out set."""
WARMUP_RAMP = 30
FINAL_LR_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class ChatModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 384
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    max_positions: int = 512
    seed: int = 0
    warmup_iterations: int = 1200
    """Enough for the model to copy a problem's numbers into a calculator call, digit by digit."""
    warmup_batch: int = 16
    warmup_lr: float = 2e-3
    """The peak: the rate rises over the first WARMUP_RAMP iterations, then decays on a cosine to a
    tenth (at a constant 6e-3 the loss spiked, and after 2,000 iterations no held-out call was right)."""
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
    config = tiny_qwen2_config(
        spec, tokenizer.get_vocab_size(), bos_id=tokenizer.token_to_id(EOS_TOKEN), eos_id=eos_id, pad_id=pad_id
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).float()
    # The warm-up renders prompts with the saved tokenizer's own chat template: exactly what the
    # task's renderer will feed the model during RL.
    _supervised_warmup(model, AutoTokenizer.from_pretrained(str(directory)), spec, eos_id, pad_id)
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def warmup_lr(spec: ChatModelSpec, iteration: int) -> float:
    ramp = min(1.0, (iteration + 1) / WARMUP_RAMP)
    cosine = 0.5 * (1 + math.cos(math.pi * iteration / spec.warmup_iterations))
    return spec.warmup_lr * ramp * (FINAL_LR_SHARE + (1 - FINAL_LR_SHARE) * cosine)


def _supervised_warmup(model, tokenizer, spec: ChatModelSpec, eos_id: int, pad_id: int) -> None:
    source = WordProblemSource(WARMUP_SEED + spec.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.warmup_lr)
    started = time.monotonic()
    model.train()
    for iteration in range(spec.warmup_iterations):
        examples = []
        for index in range(spec.warmup_batch):
            position = iteration * spec.warmup_batch + index
            problem = source.problem_at(position)
            if (position * 0.6180339887) % 1 < spec.tool_share:
                examples.append(tool_episode_example(tokenizer, problem, eos_id))
                continue
            prompt_text = tokenizer.apply_chat_template(
                list(messages_for(problem)), add_generation_prompt=True, tokenize=False
            )
            examples.append(
                answer_example(
                    tokenizer.encode(prompt_text, add_special_tokens=False),
                    tokenizer.encode(solution_text(problem), add_special_tokens=False) + [eos_id],
                )
            )
        for group in optimizer.param_groups:
            group["lr"] = warmup_lr(spec, iteration)
        loss = supervised_step(model, optimizer, examples, pad_id)
        if iteration % 10 == 0 or iteration == spec.warmup_iterations - 1:
            log.info(
                "chat warm-up", iteration=iteration, loss=round(loss, 4), seconds=round(time.monotonic() - started, 1)
            )
    model.eval()


def tool_episode_example(tokenizer, problem, eos_id: int) -> Example:
    """A whole calculator episode as the episode renders it, the loss on its two assistant turns:
    the tool call, then the boxed answer after the tool's result."""
    turns = worked_turns(problem.text, expression_of(problem), problem.answer)
    tokens: list[int] = []
    mask: list[int] = []
    for end in (2, 4):
        context = tokenizer.encode(
            tokenizer.apply_chat_template(turns[:end], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        if context[: len(tokens)] != tokens:
            raise ValueError("the chat template does not render an episode's turns as a prefix of the next")
        reply = tokenizer.encode(turns[end]["content"], add_special_tokens=False) + [eos_id]
        mask += [0] * (len(context) - len(tokens)) + [1] * len(reply)
        tokens = context + reply
    return tokens, mask
