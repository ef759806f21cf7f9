"""The default policy: a tiny Qwen2 model (random init) with the byte tokenizer, created locally
and warmed up with a short supervised run on the default task so RL starts from a non-zero reward;
and the same model warmed up on the `feedback` environment's second attempts as well."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlmesh.environments.feedback import hidden_code, marks
from rlmesh.models.tokenizer import EOS_TOKEN, PAD_TOKEN, build_char_tokenizer, save_tokenizer
from rlmesh.tasks.increment import HELD_OUT_COUNT, HELD_OUT_SEED, Problem, held_out_problems, make_problem

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 384
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    max_positions: int = 64
    seed: int = 0
    warmup_iterations: int = 100
    warmup_batch: int = 64
    warmup_lr: float = 3e-3
    feedback_share: float = 0.0
    """Share of the warm-up's problems shown as a `feedback` episode's second attempt: the problem,
    a first attempt as the increment model makes it, its marks, then the hidden code."""


FEEDBACK_MODEL_SPEC = TinyModelSpec(warmup_iterations=1200, feedback_share=0.5)
"""The `tiny-feedback` built-in model: it knows the feedback format before RL (its first attempts
still guess the hidden code, about half their digits right)."""
FIRST_ATTEMPT_SLIPS = 0.2
"""Share of the warm-up first attempts' digits drawn at random instead of incremented."""


def create_default_model(directory: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Writes config, safetensors and tokenizer to `directory` after the supervised warm-up."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    config = tiny_qwen2_config(spec, tokenizer.get_vocab_size(), bos_id=eos_id, eos_id=eos_id, pad_id=pad_id)
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).float()
    _supervised_warmup(model, tokenizer, spec, eos_id, pad_id)
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(tokenizer, directory)
    return directory


def tiny_qwen2_config(spec, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> Qwen2Config:
    """A tied Qwen2 config of a spec's shape (this module's or the chat model's)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


Example = tuple[list[int], list[int]]
"""A warm-up sequence: its token ids, and a 0/1 mask of the tokens the loss is taken on."""


def answer_example(prompt: list[int], answer: list[int]) -> Example:
    """A prompt and its answer as one sequence, the loss on the answer only."""
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def supervised_step(model, optimizer: torch.optim.Optimizer, examples: list[Example], pad_id: int) -> float:
    """One step of next-token cross-entropy on the examples, the loss on their masked tokens only."""
    width = max(len(tokens) for tokens, _ in examples)
    ids = torch.tensor([tokens + [pad_id] * (width - len(tokens)) for tokens, _ in examples])
    loss_mask = torch.tensor([mask + [0] * (width - len(mask)) for _, mask in examples], dtype=torch.float32)
    attention = torch.tensor([[1] * len(tokens) + [0] * (width - len(tokens)) for tokens, _ in examples])
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    token_loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.size(0), -1)
    loss = (token_loss * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def create_feedback_model(directory: str | Path) -> Path:
    return create_default_model(directory, FEEDBACK_MODEL_SPEC)


def feedback_warmup_example(problem: Problem, rng: random.Random, encode, eos_id: int) -> Example:
    """A feedback episode up to its second attempt, and that attempt: the hidden code."""
    code = hidden_code(problem.prompt[:-1])
    first = "".join(
        rng.choice("0123456789") if rng.random() < FIRST_ATTEMPT_SLIPS else digit for digit in problem.answer
    )
    return answer_example(
        encode(problem.prompt + first) + [eos_id] + encode(marks(first, code)), encode(code) + [eos_id]
    )


def _supervised_warmup(model, tokenizer, spec: TinyModelSpec, eos_id: int, pad_id: int) -> None:
    rng = random.Random(spec.seed + HELD_OUT_SEED + 1)
    # The held-out problems' hidden codes never show in a warm-up.
    held_out = {problem.prompt for problem in held_out_problems(HELD_OUT_COUNT)} if spec.feedback_share else set()
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.warmup_lr)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    model.train()
    for iteration in range(spec.warmup_iterations):
        examples = []
        while len(examples) < spec.warmup_batch:
            problem = make_problem(rng)
            # No draw without feedback examples: the default model's warm-up stays as it was.
            if spec.feedback_share and rng.random() < spec.feedback_share:
                if problem.prompt not in held_out:
                    examples.append(feedback_warmup_example(problem, rng, encode, eos_id))
            else:
                examples.append(answer_example(encode(problem.prompt), encode(problem.answer) + [eos_id]))
        loss = supervised_step(model, optimizer, examples, pad_id)
        if iteration % 20 == 0 or iteration == spec.warmup_iterations - 1:
            log.info("warm-up", iteration=iteration, loss=round(loss, 4))
    model.eval()
