"""Memory per session: 20,000 sessions driven through the manager's OpenAI gateway by an agent command
(a process per episode, 3 chat turns each, then its reward), batch after batch as the trainer runs
them; the manager's and the gateway's resident memory after the first 2,000 sessions (the same-run
baseline) against at the end."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import BenchMesh, InstanceSpec, write_result
from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.logging import configure_logging
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.tokenizer import IM_END_TOKEN, build_text_tokenizer, save_chat_tokenizer
from rlmesh.rpc.channels import call_options

TARGET_GROWTH = 0.02
"""The share by which either process's memory may grow from the first `--baseline-sessions` to the end."""

AGENT = '''
"""An agent harness of the soak: 3 chat turns against its session, each sending the conversation so
far, then its reward. Standard library only, so that each episode's process starts quickly."""
import http.client, json, os, urllib.parse

base = urllib.parse.urlparse(os.environ["OPENAI_BASE_URL"])
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
connection = http.client.HTTPConnection(base.hostname, base.port, timeout=120)
messages = [{"role": "system", "content": "Answer briefly."}]
for turn in range(3):
    messages.append({"role": "user", "content": f"Observation {turn}: the counter reads {turn * 7 + 3}. What next?"})
    request = json.dumps({"model": "policy", "messages": messages})
    connection.request("POST", base.path + "/chat/completions", request, headers)
    reply = connection.getresponse()
    body = json.loads(reply.read())
    if reply.status != 200:
        raise SystemExit(f"turn {turn}: {reply.status} {body}")
    messages.append(body["choices"][0]["message"])
connection.request("POST", base.path + "/rlmesh/reward", json.dumps({"reward": 1.0}), headers)
reply = connection.getresponse()
reply.read()
raise SystemExit(0 if reply.status == 200 else f"reward: {reply.status}")
'''


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"process {pid} has no VmRSS")


def gateway_pid(manager_pid: int) -> int:
    """The gateway's process: the manager's child running the gateway's entry point (exec'd, or forked
    by a warm fork server, whose title then names it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == manager_pid and "gateway" in command:
            return int(entry.name)
    raise RuntimeError(f"no gateway process under the manager ({manager_pid})")


async def run_agent(agent: Path, gateway: str, handle: manager_pb2.SessionHandle) -> int:
    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"http://{gateway}/sessions/{handle.session_id}/v1",
        "OPENAI_API_KEY": handle.key,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-S", str(agent), env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, errors = await process.communicate()
    if process.returncode:
        print(f"agent of {handle.session_id} failed: {errors.decode()[-400:]}", file=sys.stderr)
    return process.returncode


async def episode_batch(
    mesh: BenchMesh, batch_id: str, sessions: int, agent: Path, gateway: str, stop: int
) -> tuple[int, int]:
    """One batch as the trainer runs it: open, an agent per session, close, deliver, acknowledge.
    Returns (agents failed, samples delivered)."""
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=16, stop_token_ids=[stop], seed=7)
    opened = await mesh.manager.OpenSessions(
        manager_pb2.OpenSessionsRequest(
            batch_id=batch_id,
            policy_version=0,
            sampling=sampling,
            task="soak",
            prompts=[manager_pb2.Prompt(prompt_id=f"p{i}", n=4) for i in range(sessions // 4)],
            limits=manager_pb2.SessionLimits(max_turns=4, session_deadline_seconds=600),
        ),
        **call_options(30),
    )
    codes = await asyncio.gather(*(run_agent(agent, gateway, h) for h in opened.sessions))
    for handle, code in zip(opened.sessions, codes):
        status = manager_pb2.SESSION_STATUS_DONE if code == 0 else manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR
        await mesh.manager.CloseSession(
            manager_pb2.CloseSessionRequest(session_id=handle.session_id, status=status), **call_options(30)
        )
    delivered = 0
    async for reply in mesh.manager.StreamRollouts(
        manager_pb2.StreamRolloutsRequest(batch_id=batch_id, micro_batch_groups=4), **call_options(120)
    ):
        delivered += sum(len(g.samples) for g in reply.groups)
    await mesh.manager.AcknowledgeRollouts(
        manager_pb2.AcknowledgeRolloutsRequest(batch_id=batch_id), **call_options(30)
    )
    return sum(1 for code in codes if code), delivered


async def soak(args: argparse.Namespace, scratch: Path) -> tuple[dict, dict, dict]:
    tokenizer = build_text_tokenizer()
    save_chat_tokenizer(tokenizer, scratch, model_max_length=4096)
    agent = scratch / "agent.py"
    agent.write_text(AGENT)
    gateway_port = free_port()
    engine = {
        "ENGINE__SYNTHETIC__VOCAB_SIZE": str(tokenizer.get_vocab_size()),
        "ENGINE__SYNTHETIC__MEAN_TOKENS": "12",
        "ENGINE__MAX_BATCH_SIZE": str(args.concurrency),
    }
    instances = [InstanceSpec(f"synthetic-{i}", settings=engine) for i in range(2)]
    samples: list[tuple[int, int, int]] = []
    failed = delivered = 0
    started = time.perf_counter()
    async with BenchMesh(instances, {"GATEWAY_PORT": str(gateway_port), "MODEL_DIR": str(scratch)}) as mesh:
        manager_pid = next(c.process.pid for c in mesh.children if c.name == "manager")
        gateway = gateway_pid(manager_pid)
        done = 0
        while done < args.sessions:
            batch_failed, batch_delivered = await episode_batch(
                mesh,
                f"soak-{done}",
                args.concurrency,
                agent,
                f"127.0.0.1:{gateway_port}",
                tokenizer.token_to_id(IM_END_TOKEN),
            )
            failed += batch_failed
            delivered += batch_delivered
            done += args.concurrency
            samples.append((done, resident_bytes(manager_pid), resident_bytes(gateway)))
            if done % 1000 < args.concurrency:
                print(
                    f"{done} sessions: manager {samples[-1][1] / 2**20:.1f} MiB, "
                    f"gateway {samples[-1][2] / 2**20:.1f} MiB, {time.perf_counter() - started:.0f} s",
                    flush=True,
                )
    at_baseline = next(s for s in samples if s[0] >= args.baseline_sessions)
    end = samples[-1]
    figures = {
        "sessions": done,
        "agents_failed": failed,
        "samples_delivered": delivered,
        "manager_resident_mib_end": end[1] / 2**20,
        "gateway_resident_mib_end": end[2] / 2**20,
        "seconds": time.perf_counter() - started,
        "resident_mib_by_sessions": [
            [s, round(m / 2**20, 2), round(g / 2**20, 2)] for s, m, g in samples[:: max(1, len(samples) // 40)]
        ],
    }
    baseline = {
        "baseline_sessions": at_baseline[0],
        "manager_resident_mib_at_baseline": at_baseline[1] / 2**20,
        "gateway_resident_mib_at_baseline": at_baseline[2] / 2**20,
    }
    ratios = {"manager_growth": end[1] / at_baseline[1] - 1, "gateway_growth": end[2] / at_baseline[2] - 1}
    return figures, baseline, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--baseline-sessions", type=int, default=2_000)
    parser.add_argument(
        "--concurrency", type=int, default=32, help="sessions a batch (each its own agent process), a multiple of 4"
    )
    args = parser.parse_args()
    configure_logging(service="bench")
    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-soak-") as scratch:
        figures, baseline, ratios = asyncio.run(soak(args, Path(scratch)))
    write_result(
        "soak",
        figures,
        baseline,
        ratios,
        {
            f"manager_growth < {TARGET_GROWTH}": ratios["manager_growth"] < TARGET_GROWTH,
            f"gateway_growth < {TARGET_GROWTH}": ratios["gateway_growth"] < TARGET_GROWTH,
            "agents_failed == 0": figures["agents_failed"] == 0,
            "samples_delivered == sessions": figures["samples_delivered"] == figures["sessions"],
        },
        {
            "sessions": args.sessions,
            "baseline_sessions": args.baseline_sessions,
            "concurrency": args.concurrency,
            "agent": "python -S agent.py (standard library, 3 chat turns, then POST /rlmesh/reward)",
            "engine": "synthetic, 2 instances",
            "turn_tokens": "synthetic lengths, mean 12, at most 16",
        },
    )


if __name__ == "__main__":
    main()
