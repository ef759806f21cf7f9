"""The verifiers harness rlmesh runs a verifiers environment's episodes with (harness id
`rlmesh_verifiers`): verifiers' own tool-calling chat program, the one its `null` harness runs,
run inside the episode process instead of as a `uv` script per episode (which fetches packages)."""

from __future__ import annotations

import argparse
import asyncio
import traceback
from contextlib import AsyncExitStack
from functools import cache
from typing import Any

import httpx
from openai import AsyncOpenAI
from verifiers.v1 import ModelContext, ProgramResult, Runtime, TaskData, Trace
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

MCP_CONNECT_SECONDS = 60.0


@cache
def chat_program() -> dict[str, Any]:
    """The chat program's namespace: verifiers ships it as one script of its utils modules."""
    namespace: dict[str, Any] = {"__name__": "verifiers_chat_program"}
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)  # noqa: S102 - verifiers' own program
    return namespace


class InProcessChatHarness(NullHarness):
    """The `null` harness's program, called in this process: its model calls still go through the
    endpoint verifiers gives it (its interception server, which records the trace)."""

    async def setup(self, runtime: Runtime) -> None:
        chat_program()

    async def launch(
        self,
        ctx: ModelContext,
        trace: Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        program = chat_program()
        system_prompt, prompt = self.resolve_prompt(data)
        # What the program's own main() parses from its command line, for the loop it runs.
        args = argparse.Namespace(
            base_url=endpoint,
            api_key=secret,
            model=ctx.model,
            system_prompt=system_prompt or "",
            prompt="",
            initial_messages_file="",
            mcp_config="",
            tool_interception_url=tool_interception_url or "",
            bash=False,
            compaction=False,
            summarize_at_tokens=None,
            edit=False,
            search=False,
            serper_key="",
        )
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, timeout=httpx.Timeout(None, connect=5.0))
        tool_client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) if tool_interception_url else None
        try:
            async with AsyncExitStack() as servers_stack:
                tools, dispatch, servers = [], {}, {}
                if mcp_urls:
                    config = {
                        "mcpServers": {
                            name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()
                        }
                    }
                    tools, dispatch, servers = await asyncio.wait_for(
                        program["connect_mcp"](config, servers_stack, set()), MCP_CONNECT_SECONDS
                    )
                messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
                if isinstance(prompt, str):
                    messages.append({"role": "user", "content": prompt})
                elif prompt is not None:
                    messages.extend(message_to_wire(message) for message in prompt)
                compactor = program["Compactor"](client, ctx.model, tools, False, None)
                compactor.note_good(messages)
                await program["run_chat_loop"](args, compactor, messages, dispatch, servers, tool_client)
        except SystemExit as exc:  # the program exits this way when the model cannot be reached
            code = exc.code if isinstance(exc.code, int) else MODEL_TRANSPORT_ERROR_EXIT_CODE
            return ProgramResult(code, "", traceback.format_exc())
        except Exception:  # noqa: BLE001 - reported as the program's failure, as a crashed script's would be
            return ProgramResult(1, "", traceback.format_exc())
        finally:
            await client.close()
            if tool_client is not None:
                await tool_client.aclose()
        return ProgramResult(0, "", "")


__all__ = ["InProcessChatHarness"]
