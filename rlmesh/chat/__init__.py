"""Chat on a session's token stream: rendering turns, stop strings, tool calls, and how a harness
reaches the gateway.

- `gateway_client`: a session's base URL on the manager's OpenAI gateway and the CA bundle a harness trusts.
- `stop_strings`: OpenAI's `stop`: where a response ends once its text contains a stop string.
- `tool_calls`: the model's Hermes / Qwen `<tool_call>` syntax read into OpenAI `tool_calls`.
- `turns`: renders a conversation into a session's token stream turn by turn, never re-tokenizing the model's.
"""
