"""The manager's OpenAI-compatible gateway, a process of its own beside the manager.

- `app`: The manager's OpenAI-compatible gateway (Starlette, served by uvicorn in a process of its own beside the manager's).
- `main`: The manager's OpenAI gateway as a process of its own, started and watched by the manager.
- `openai_format`: OpenAI's wire format for the gateway.
- `process`: Runs the manager's OpenAI gateway in a process of its own.
- `requests`: What the gateway reads of a request body, checked before anything runs.
- `sessions`: The gateway process's view of the sessions harnesses reach it for.
"""
