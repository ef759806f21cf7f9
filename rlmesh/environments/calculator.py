"""The `calculator` built-in environment: a word problem with a calculator tool. The model may call
the tool (Hermes / Qwen <tool_call> form) and gets its result as a tool message; its answer in
\\boxed{} ends the episode with reward 1 when it is right. Without tools, the same episodes are
answered directly: the baseline the tool is measured against."""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Mapping
from typing import Any

from rlmesh.chat.tool_calls import tool_call_text
from rlmesh.environments.base import Action, EnvironmentFailure, StepResult

TOOL_SYSTEM = "Tool: calculator(expression). Answer as \\boxed{n}."
PLAIN_SYSTEM = "Answer as \\boxed{n}."
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
MAX_EXPRESSION = 64
_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> str:
    """The value of an integer expression with + - * / and parentheses, as text; an error's text otherwise."""
    if len(expression) > MAX_EXPRESSION:
        return f"error: expression longer than {MAX_EXPRESSION} characters"
    try:
        value = _value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def _value(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int)
        and not isinstance(node.value, bool)
        and abs(node.value) < 10**9
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("only integers, + - * / and parentheses")


def question_of(row: Mapping[str, Any]) -> str:
    """The problem's text from a word-problem row (its user message, without the task's instruction)."""
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        prompt = next(
            (m.get("content", "") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"), None
        )
    if not isinstance(prompt, str) or not prompt:
        raise EnvironmentFailure(f"calculator: the row has no problem text under 'prompt' (keys: {sorted(row)})")
    return prompt.replace(" Put the final answer in \\boxed{}.", "")


def opening(question: str, tools: bool) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": TOOL_SYSTEM if tools else PLAIN_SYSTEM},
        {"role": "user", "content": question},
    ]


def worked_turns(question: str, expression: str, answer: int) -> list[dict[str, str]]:
    """A solved episode with one tool call: what the tiny chat model's warm-up teaches."""
    return [
        *opening(question, True),
        {"role": "assistant", "content": tool_call_text("calculator", {"expression": expression})},
        {"role": "tool", "content": evaluate(expression)},
        {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
    ]


class CalculatorEnvironment:
    """One episode: calls are answered until the model answers in \\boxed{} (or runs out of turns)."""

    def __init__(self, tools: bool = True) -> None:
        self.tools = tools
        self.answer = ""

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        if "answer" not in row:
            raise EnvironmentFailure(f"calculator: the row has no 'answer' (keys: {sorted(row)})")
        self.answer = str(row["answer"]).strip()
        return opening(question_of(row), self.tools)

    def step(self, action: Action) -> StepResult:
        calls = [c for c in action.tool_calls if c.name == "calculator"] if self.tools else []
        if calls:
            return StepResult(
                [{"role": "tool", "content": evaluate(_expression(c.arguments))} for c in calls], 0.0, False
            )
        found = _BOXED.search(action.text)
        return StepResult([], float(found is not None and found.group(1) == self.answer), True)


def _expression(arguments: str) -> str:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return ""
    return str(parsed.get("expression", "")) if isinstance(parsed, dict) else ""
