"""The OpenAI gateway's cost: tokens/s of 64 concurrent multi-turn sessions driven through the HTTP
gateway (chat completions, each request carrying the whole conversation, as harnesses send it)
against the same sessions driven through the gRPC session contract (RunTurn), in the same run on
the same manager and synthetic instances; the latency the gateway adds to a turn (p50, p99); and
the manager's single-turn relay rate while those sessions run through the gateway (its process
beside the manager's, calling RunTurn), against while they run through the contract directly."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import relay
from bench.common import BenchMesh, InstanceSpec, check_exactly_once, write_result
from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.logging import configure_logging
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.tokenizer import IM_END_TOKEN, build_text_tokenizer, save_chat_tokenizer
from rlmesh.rpc.channels import call_options

TARGET_RATIO = 0.8
RELAY_TARGET_RATIO = 0.9
"""The relay beside gateway sessions against beside the same sessions over the contract: what the
gateway's process and its calls cost the manager's relay."""
MAX_TURNS = 64
USER_TEXT = "Tell me the next number in the list, then say why in one short line."


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


async def open_batch(
    mesh: BenchMesh, batch_id: str, sessions: int, max_tokens: int, stop: int
) -> list[manager_pb2.SessionHandle]:
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=[stop], seed=7)
    reply = await mesh.manager.OpenSessions(
        manager_pb2.OpenSessionsRequest(
            batch_id=batch_id,
            policy_version=0,
            sampling=sampling,
            task="bench",
            prompts=[manager_pb2.Prompt(prompt_id="p", n=sessions)],
            limits=manager_pb2.SessionLimits(max_turns=MAX_TURNS),
        ),
        **call_options(30),
    )
    return list(reply.sessions)


async def finish_batch(mesh: BenchMesh, batch_id: str, handles: list[manager_pb2.SessionHandle]) -> None:
    for handle in handles:
        await mesh.manager.CloseSession(
            manager_pb2.CloseSessionRequest(session_id=handle.session_id, status=manager_pb2.SESSION_STATUS_DONE),
            **call_options(30),
        )
    async for _ in mesh.manager.StreamRollouts(
        manager_pb2.StreamRolloutsRequest(batch_id=batch_id, micro_batch_groups=1), **call_options(60)
    ):
        pass
    await mesh.manager.AcknowledgeRollouts(
        manager_pb2.AcknowledgeRolloutsRequest(batch_id=batch_id), **call_options(30)
    )


async def through_contract(
    mesh: BenchMesh, handles, turns: int, observation: list[int], until: asyncio.Event | None = None
) -> tuple[int, float, list[float]]:
    """(tokens generated, seconds, per-turn latencies) of every session's turns through RunTurn;
    with `until`, each session stops after the turn during which it was set."""
    latencies: list[float] = []

    async def session(handle) -> int:
        tokens = 0
        for turn in range(turns):
            if until is not None and until.is_set():
                break
            started = time.perf_counter()
            reply = await mesh.manager.RunTurn(
                manager_pb2.RunTurnRequest(
                    session_id=handle.session_id,
                    turn=turn,
                    append=[manager_pb2.Segment(source=manager_pb2.SEGMENT_SOURCE_ENVIRONMENT, token_ids=observation)],
                ),
                **call_options(120),
            )
            latencies.append(time.perf_counter() - started)
            tokens += len(reply.generated.token_ids)
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(session(h) for h in handles))
    return sum(counts), time.perf_counter() - started, latencies


async def through_gateway(
    gateway: str, handles, turns: int, until: asyncio.Event | None = None
) -> tuple[int, float, list[float]]:
    """The same through the HTTP gateway: each request carries the conversation so far."""
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=len(handles))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:

        async def session(handle) -> int:
            url = f"http://{gateway}/sessions/{handle.session_id}/v1/chat/completions"
            headers = {"Authorization": f"Bearer {handle.key}"}
            messages = [{"role": "system", "content": "Be brief."}]
            tokens = 0
            for _ in range(turns):
                if until is not None and until.is_set():
                    break
                messages.append({"role": "user", "content": USER_TEXT})
                started = time.perf_counter()
                async with client.post(url, json={"model": "policy", "messages": messages}, headers=headers) as reply:
                    reply.raise_for_status()
                    body = await reply.json()
                latencies.append(time.perf_counter() - started)
                messages.append(body["choices"][0]["message"])
                tokens += body["usage"]["completion_tokens"]
            return tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(session(h) for h in handles))
    return sum(counts), time.perf_counter() - started, latencies


async def measure(args: argparse.Namespace, tokenizer_dir: Path) -> tuple[dict, dict, dict]:
    tokenizer = build_text_tokenizer()
    stop = tokenizer.token_to_id(IM_END_TOKEN)
    observation = tokenizer.encode(USER_TEXT).ids
    gateway_port = free_port()
    engine = {
        "ENGINE__SYNTHETIC__VOCAB_SIZE": str(tokenizer.get_vocab_size()),
        "ENGINE__SYNTHETIC__LENGTH": "fixed",
        "ENGINE__SYNTHETIC__MEAN_TOKENS": str(args.turn_tokens),
        "ENGINE__MAX_BATCH_SIZE": str(args.sessions),
        "ENGINE__SYNTHETIC__THROUGHPUT_TOKENS_PER_SECOND": str(args.engine_tokens_per_second),
    }
    instances = [InstanceSpec(f"synthetic-{i}", settings=engine) for i in range(args.instances)]
    manager = {"GATEWAY_PORT": str(gateway_port), "MODEL_DIR": str(tokenizer_dir)}
    contract_runs, gateway_runs = [], []
    async with BenchMesh(instances, manager) as mesh:
        gateway = f"127.0.0.1:{gateway_port}"
        # The first round is a warm-up: a fresh process's first requests compile the chat template
        # and fill its caches.
        for round_ in range(args.rounds + 1):
            for name, runs in (("grpc", contract_runs), ("http", gateway_runs)):
                batch_id = f"{name}-{round_}"
                handles = await open_batch(mesh, batch_id, args.sessions, args.turn_tokens, stop)
                if name == "grpc":
                    run = await through_contract(mesh, handles, args.turns, observation)
                else:
                    run = await through_gateway(gateway, handles, args.turns)
                await finish_batch(mesh, batch_id, handles)
                if round_:
                    runs.append(run)

    def rate(runs) -> float:
        return sum(t for t, _, _ in runs) / sum(s for _, s, _ in runs)

    contract_latency = [x for _, _, latencies in contract_runs for x in latencies]
    gateway_latency = [x for _, _, latencies in gateway_runs for x in latencies]
    figures = {
        "gateway_tokens_per_second": rate(gateway_runs),
        "gateway_turn_p50_seconds": percentile(gateway_latency, 0.5),
        "gateway_turn_p99_seconds": percentile(gateway_latency, 0.99),
        "gateway_added_p50_ms": 1000 * (percentile(gateway_latency, 0.5) - percentile(contract_latency, 0.5)),
        "gateway_added_p99_ms": 1000 * (percentile(gateway_latency, 0.99) - percentile(contract_latency, 0.99)),
        "turns_through_gateway": len(gateway_latency),
    }
    baseline = {
        "contract_tokens_per_second": rate(contract_runs),
        "contract_turn_p50_seconds": percentile(contract_latency, 0.5),
        "contract_turn_p99_seconds": percentile(contract_latency, 0.99),
        "turns_through_contract": len(contract_latency),
        "mean_turn_tokens": statistics.mean(t / (args.sessions * args.turns) for t, _, _ in contract_runs),
    }
    ratios = {
        "gateway_over_contract_tokens_per_second": figures["gateway_tokens_per_second"]
        / baseline["contract_tokens_per_second"]
    }
    return figures, baseline, ratios


async def relay_beside_sessions(
    args: argparse.Namespace, tokenizer_dir: Path
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Tokens/s of the manager's single-turn relay (bench.relay's step on its fast synthetic engines)
    per round: alone, while the sessions run through the contract, and while they run through the
    gateway; the sessions turn until the relay's step is back. Also the sessions' turns per round."""
    tokenizer = build_text_tokenizer()
    stop = tokenizer.token_to_id(IM_END_TOKEN)
    observation = tokenizer.encode(USER_TEXT).ids
    gateway_port = free_port()
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=relay.LENGTH + 1)
    rates: dict[str, list[float]] = {"alone": [], "grpc": [], "http": []}
    turns: dict[str, list[int]] = {"grpc": [], "http": []}
    async with BenchMesh(
        relay.instance_specs(), {"GATEWAY_PORT": str(gateway_port), "MODEL_DIR": str(tokenizer_dir)}
    ) as mesh:
        await mesh.run_step("relay-warmup", relay.PROMPTS // 4, relay.GROUP_SIZE, sampling)
        for round_ in range(args.relay_rounds + 1):
            for name in rates:
                batch_id = f"beside-{name}-{round_}"
                until = asyncio.Event()
                handles, sessions = [], None
                if name != "alone":
                    handles = await open_batch(mesh, batch_id, args.sessions, args.turn_tokens, stop)
                    sessions = asyncio.create_task(
                        through_contract(mesh, handles, MAX_TURNS, observation, until)
                        if name == "grpc"
                        else through_gateway(f"127.0.0.1:{gateway_port}", handles, MAX_TURNS, until)
                    )
                    # The relay's step starts once the sessions' first turns are under way.
                    await asyncio.sleep(0.2)
                result = await mesh.run_step(f"relay-{name}-{round_}", relay.PROMPTS, relay.GROUP_SIZE, sampling)
                lost, duplicated = check_exactly_once(result, relay.PROMPTS, relay.GROUP_SIZE)
                assert lost == duplicated == 0, "the relay lost or duplicated tokens"
                if sessions is not None:
                    until.set()
                    _, _, latencies = await sessions
                    await finish_batch(mesh, batch_id, handles)
                # The first round is a warm-up.
                if round_:
                    rates[name].append(result.tokens / result.seconds)
                    if sessions is not None:
                        turns[name].append(len(latencies))
    return rates, turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds, after one warm-up round")
    parser.add_argument(
        "--relay-rounds",
        type=int,
        default=5,
        help="rounds of the relay beside the sessions (each: alone, beside the contract, beside the gateway)",
    )
    parser.add_argument("--engine-tokens-per-second", type=float, default=20000.0)
    args = parser.parse_args()
    configure_logging(service="bench")
    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-gateway-") as scratch:
        save_chat_tokenizer(build_text_tokenizer(), Path(scratch), model_max_length=4096)
        figures, baseline, ratios = asyncio.run(measure(args, Path(scratch)))
        beside, beside_turns = asyncio.run(relay_beside_sessions(args, Path(scratch)))
    figures["relay_beside_gateway_sessions_tokens_per_second_median"] = statistics.median(beside["http"])
    figures["relay_beside_gateway_sessions_rounds"] = beside["http"]
    figures["gateway_turns_beside_relay_rounds"] = beside_turns["http"]
    baseline["relay_beside_contract_sessions_tokens_per_second_median"] = statistics.median(beside["grpc"])
    baseline["relay_beside_contract_sessions_rounds"] = beside["grpc"]
    baseline["contract_turns_beside_relay_rounds"] = beside_turns["grpc"]
    baseline["relay_alone_tokens_per_second_median"] = statistics.median(beside["alone"])
    baseline["relay_alone_rounds"] = beside["alone"]
    relay_ratio = statistics.median(beside["http"]) / statistics.median(beside["grpc"])
    ratios["relay_beside_gateway_over_beside_contract"] = relay_ratio
    ratio = ratios["gateway_over_contract_tokens_per_second"]
    write_result(
        "gateway",
        figures,
        baseline,
        ratios,
        {
            f"gateway_over_contract_tokens_per_second >= {TARGET_RATIO}": ratio >= TARGET_RATIO,
            f"relay_beside_gateway_over_beside_contract >= {RELAY_TARGET_RATIO}": relay_ratio >= RELAY_TARGET_RATIO,
        },
        {
            "sessions": args.sessions,
            "turns": args.turns,
            "turn_tokens": args.turn_tokens,
            "instances": args.instances,
            "rounds": args.rounds,
            "engine": "synthetic",
            "engine_tokens_per_second": args.engine_tokens_per_second,
            "gateway": "a process of its own beside the manager's (uvloop, httptools, Starlette)",
            "relay_rounds": args.relay_rounds,
            "relay": {
                "instances": relay.INSTANCES,
                "samples_per_round": relay.PROMPTS * relay.GROUP_SIZE,
                "tokens_per_sample": relay.LENGTH,
                "synthetic": relay.SYNTHETIC,
            },
        },
    )


if __name__ == "__main__":
    main()
