"""The manager's OpenAI-compatible gateway, a process of its own beside the manager, through which
agent harnesses make a session's turns.

- `app`: the HTTP app: `/v1/chat/completions` and `/v1/completions` per session, matched to its conversation.
- `main`: the gateway process's entry: serves the app on the manager's socket, runs turns over gRPC.
- `openai_format`: OpenAI's wire format: completions and chat completions, whole or streamed, and errors.
- `process`: the manager's side: binds the port, starts the gateway process, restarts it, stops it.
- `requests`: checks a request body before anything runs; a refusal names the field at fault.
- `sessions`: the gateway's bounded cache of the sessions it serves, kept in step with their turns.
"""
