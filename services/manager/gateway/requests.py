"""What the gateway reads of a request body, checked before anything runs: each field it reads has
the type and range it must, and what it cannot honour (n > 1, logit_bias, constrained output...) is
refused by name. Every refusal is a 400 whose message starts with the field's path
(`messages[2].content[0]: ...`); nothing malformed reaches the rendering or the manager."""

from __future__ import annotations

import math
from typing import Any

from rlmesh.chat.stop_strings import stop_problem
from services.manager.gateway.openai_format import GatewayError

UINT32 = 1 << 32
FLOAT32_MAX = 3.4028234663852886e38

REFUSED_CHAT = {
    "logit_bias": "biasing the model's logits is not supported: the trainer's logprobs are the task's sampling",
    "functions": "the legacy functions API is not supported: offer `tools`",
    "function_call": "the legacy functions API is not supported: offer `tools`",
}
REFUSED_COMPLETION = {
    "logit_bias": REFUSED_CHAT["logit_bias"],
    "suffix": "a suffix (fill-in-the-middle) is not supported",
}
"""Fields refused whenever they are set to anything but null (or an empty value)."""


class Invalid(GatewayError):
    """A field of the body the gateway cannot take: a 400 naming it (OpenAI's `param`)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(400, f"{path}: {problem}", param=path)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise Invalid(name, f"must be {what}, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unset(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == "" or value == {} or value == []


def check_refused(body: dict[str, Any], refused: dict[str, str]) -> None:
    for name, why in refused.items():
        if not _unset(body.get(name)):
            raise Invalid(name, why)


def check_common(body: dict[str, Any]) -> None:
    """The fields chat and text completions share: n, max tokens, stream, stop and the penalties."""
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise Invalid("n", f"must be 1: a session is one trajectory, got {_shown(n)}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not _is_int(value) or not 1 <= value < UINT32):
            raise Invalid(name, f"must be a positive integer below 2^32, got {_shown(value)}")
    _optional(body, "stream", bool, "true or false")
    options = _optional(body, "stream_options", dict, "an object")
    if (
        options is not None
        and options.get("include_usage") is not None
        and not isinstance(options["include_usage"], bool)
    ):
        raise Invalid("stream_options.include_usage", f"must be true or false, got {_shown(options['include_usage'])}")
    stop_strings(body)
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value != 0):
            raise Invalid(
                name,
                "penalties are not supported: the trainer's logprobs are the task's sampling (give 0 or leave it out)",
            )


def stop_strings(body: dict[str, Any]) -> list[str]:
    """The request's stop strings (OpenAI's `stop`: a string or a list of them)."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise Invalid("stop", f"must be a string or a list of strings, got {_shown(stop)}")
    problem = stop_problem(stops)
    if problem:
        raise Invalid("stop", problem)
    return stops


def check_chat(body: dict[str, Any]) -> None:
    """A chat completion's body: its messages, tools and options."""
    check_refused(body, REFUSED_CHAT)
    check_common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Invalid("messages", f"must be a non-empty list of message objects, got {_shown(messages)}")
    for index, message in enumerate(messages):
        _check_message(f"messages[{index}]", message)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise Invalid("tools", f"must be a list of tools, got {_shown(tools)}")
        for index, tool in enumerate(tools):
            _check_tool(f"tools[{index}]", tool)
    _check_tool_choice(body.get("tool_choice"), bool(tools))
    _optional(body, "logprobs", bool, "true or false")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or top != 0):
        raise Invalid(
            "top_logprobs",
            "alternatives are not kept: each token's own logprob is in `logprobs` and the rlmesh extension",
        )
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise Invalid(
            "response_format",
            'only {"type": "text"} is supported: constrained output would not be what the model samples',
        )


def _check_message(path: str, message: Any) -> None:
    if not isinstance(message, dict):
        raise Invalid(path, f"must be a message object, got {_shown(message)}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise Invalid(f"{path}.role", f"must be a string (system, user, assistant, tool...), got {_shown(role)}")
    content = message.get("content")
    if isinstance(content, list):
        for index, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or not isinstance(part.get("type", "text"), str)
                or (part.get("type", "text") == "text" and not isinstance(part.get("text"), str))
            ):
                raise Invalid(
                    f"{path}.content[{index}]",
                    f'a text part must be an object with a string "text", got {_shown(part)}',
                )
    elif content is not None and not isinstance(content, str):
        raise Invalid(f"{path}.content", f"must be a string, a list of content parts or null, got {_shown(content)}")
    for name in ("name", "tool_call_id"):
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            raise Invalid(f"{path}.{name}", f"must be a string, got {_shown(value)}")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise Invalid(f"{path}.tool_calls", f"must be a list of tool calls, got {_shown(calls)}")
    for index, call in enumerate(calls):
        where = f"{path}.tool_calls[{index}]"
        if not isinstance(call, dict):
            raise Invalid(where, f"must be a tool call object, got {_shown(call)}")
        for name in ("id", "type"):
            if call.get(name) is not None and not isinstance(call[name], str):
                raise Invalid(f"{where}.{name}", f"must be a string, got {_shown(call[name])}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise Invalid(
                f"{where}.function", f'must be an object with a string "name" and "arguments", got {_shown(function)}'
            )
        if not isinstance(function.get("name"), str):
            raise Invalid(f"{where}.function.name", f"must be a string, got {_shown(function.get('name'))}")
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, (str, dict)):
            raise Invalid(
                f"{where}.function.arguments", f"must be a JSON string (or an object), got {_shown(arguments)}"
            )


def _check_tool(path: str, tool: Any) -> None:
    if not isinstance(tool, dict) or not isinstance(tool.get("type", "function"), str):
        raise Invalid(path, f'must be a tool object ({{"type": "function", "function": {{...}}}}), got {_shown(tool)}')
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Invalid(f"{path}.function", f'must be an object with a string "name", got {_shown(function)}')
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise Invalid(f"{path}.function.parameters", f"must be a JSON schema object, got {_shown(parameters)}")


def _check_tool_choice(choice: Any, tools: bool) -> None:
    # The model chooses whether to call a tool: forcing one (or none, while tools are offered)
    # would take constrained decoding, and what it samples would not be what is trained.
    if choice is None or choice == "auto" or (choice == "none" and not tools):
        return
    raise Invalid(
        "tool_choice", f'only "auto" is supported (the model chooses; "none" only without tools), got {_shown(choice)}'
    )


def check_completion(body: dict[str, Any]) -> None:
    """A text completion's body: one prompt (text or token ids) and its options."""
    check_refused(body, REFUSED_COMPLETION)
    check_common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
        if all(isinstance(p, (str, list)) for p in prompt):
            raise Invalid(
                "prompt",
                "a batch of prompts is not supported: send one prompt (a string or a list of token ids) per request",
            )
        bad = next(i for i, t in enumerate(prompt) if not _is_int(t))
        raise Invalid(f"prompt[{bad}]", f"must be a token id (an integer), got {_shown(prompt[bad])}")
    if isinstance(prompt, list):
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < UINT32), None)
        if bad is not None:
            raise Invalid(f"prompt[{bad}]", f"a token id must be in [0, 2^32), got {prompt[bad]}")
    if not (isinstance(prompt, str) or isinstance(prompt, list)) or not prompt:
        raise Invalid("prompt", f"must be a non-empty string or a list of token ids, got {_shown(prompt)}")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise Invalid("best_of", "must be 1: a session is one trajectory")
    echo = body.get("echo")
    if echo is not None and echo is not False:
        raise Invalid(
            "echo", "echoing the prompt is not supported: the turn's own tokens are in the response's rlmesh extension"
        )
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs != 0):
        raise Invalid(
            "logprobs",
            "alternatives are not kept: the turn's token ids and logprobs are in the response's rlmesh extension",
        )


def reward_of(body: dict[str, Any]) -> tuple[float, int | None]:
    """A reported reward and the turn it is for (None: the episode's final reward)."""
    value, turn = body.get("reward"), body.get("turn")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(
            "reward", f'give {{"reward": <number>}} and optionally {{"turn": <turn index>}}, got {_shown(value)}'
        )
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise Invalid("reward", f"must be a finite number within float32's range, got {_shown(value)}")
    if turn is not None and (not _is_int(turn) or not 0 <= turn < UINT32):
        raise Invalid("turn", f"must be a turn index in [0, 2^32), got {_shown(turn)}")
    return float(value), turn
