"""Chat on a session's token stream: rendering turns, stop strings, tool calls, and how a harness reaches the gateway.

- `gateway_client`: How a harness reaches its session on the manager's OpenAI gateway.
- `stop_strings`: Stop strings (OpenAI's `stop`).
- `tool_calls`: The model's tool-call syntax read into OpenAI `tool_calls`.
- `turns`: Renders a conversation into a session's token stream turn by turn.
"""
