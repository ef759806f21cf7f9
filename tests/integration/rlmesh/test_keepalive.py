"""Keepalive settings agree: a server and a client from rlmesh.rpc ping an idle connection every
200 ms for seconds, the server counts none of those pings as abuse (no strike, no GOAWAY), and
the same connection still serves a call."""

import asyncio
import os
import re
import subprocess
import sys

IDLE_SECONDS = 5.0
"""grpc core clients ping at most once a second: under a policy that counted their pings as abuse,
the third strike (the fourth ping) would come within this."""

CHILD = """
import asyncio, os, sys
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rlmesh.config import AuthSettings, ServerConfig
from rlmesh.rpc.channels import Keepalive, call_options, open_channel
from rlmesh.rpc.servers import GrpcServer

async def main(idle):
    keepalive = Keepalive(time_ms=200, timeout_ms=1000)
    auth = AuthSettings(verifiers_file=os.path.join(os.environ["RLMESH_TEST_SECRETS"], "verifiers.json"))
    server = GrpcServer(ServerConfig(host="127.0.0.1", port=0, grace_seconds=0.1, auth=auth), [], keepalive=keepalive)
    await server.start()
    await server.set_serving(True)
    async with open_channel(server.address, keepalive=keepalive) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), **call_options(5))
        await asyncio.sleep(idle)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), **call_options(5))
        print("after idle:", health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), flush=True)
    await server.stop()

asyncio.run(main(float(sys.argv[1])))
"""


async def test_idle_connection_survives_keepalive_pings_without_a_goaway():
    env = {**os.environ, "GRPC_VERBOSITY": "debug", "GRPC_TRACE": "http_keepalive"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(IDLE_SECONDS), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    trace = err.decode()
    assert process.returncode == 0, trace[-3000:]
    assert "after idle: SERVING" in out.decode()
    received = re.findall(r"SERVER\[(0x[0-9a-f]+)\]: received ping .* ping_strikes=(\d+)", trace)
    print(
        f"server received {len(received)} pings in {IDLE_SECONDS:.0f} s idle; "
        f"strikes {sorted({int(s) for _, s in received})}"
    )
    # Keepalive was exercised: the client pinged throughout the idle time, ...
    assert len(received) >= 4, trace[-3000:]
    # ...the server took none of it for abuse, ...
    assert all(strikes == "0" for _, strikes in received), trace[-3000:]
    assert not re.search(r"goaway|too_many_pings|too many pings", trace, re.IGNORECASE), trace[-3000:]
    # ...and the connection was never replaced: one transport on each side.
    assert len({transport for transport, _ in received}) == 1
    assert len(set(re.findall(r"CLIENT\[(0x[0-9a-f]+)\]", trace))) == 1
