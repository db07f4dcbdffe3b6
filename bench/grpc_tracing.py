"""What the server's tracing costs a gRPC call, measured apart from the rest of a job.

``python -m bench.grpc_tracing``: a grpc.aio server in a child process (its
heap settled as jobplane's are, ADR-0032) answers health checks from 32
callers; its CPU a call is read from ``/proc`` over ``--calls`` calls. Arms:
tracing off, then :class:`~jobplane.observe.tracing.ServerTracing` on the
health service with nothing sampled, one call in ten and every call,
exporting over OTLP/HTTP to a receiver on loopback. The handler takes the
call's outgoing trace context as SubmitJob does. ``--rounds`` rounds, the
arms in the same order each (each arm a fresh process, so nothing carries
over). The server's whole CPU is counted, its export thread's too, until
the batch processor's schedule has passed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench import procstat
from tests.otlp_receiver import Receiver
from tests.support.ports import free_port

#: Arm name → the sampler's share (None: tracing off).
ARMS: dict[str, float | None] = {"off": None, "nothing": 0.0, "one in ten": 0.1, "every": 1.0}
CALLERS = 32
#: Past the batch span processor's schedule (5 s): the calls' spans are exported.
EXPORT_PAUSE = 5.5


async def _serve(port: int, traced: bool) -> None:
    from jobplane import heap
    from jobplane.observe import tracing

    interceptors: list[grpc.aio.ServerInterceptor] = []
    if traced:
        if not tracing.configure_tracing("bench-grpc"):
            raise SystemExit("tracing did not start: no OTEL exporter configured")
        interceptors.append(tracing.ServerTracing(prefix="/grpc.health."))

    class Health(health.aio.HealthServicer):
        async def Check(self, request: Any, context: Any) -> Any:
            tracing.outgoing(None, None)  # what SubmitJob stores with its outbox row
            return await super().Check(request, context)

    server = grpc.aio.server(interceptors=interceptors)
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    heap.settle()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _load(port: int, calls: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)

        async def caller(n: int) -> None:
            for _ in range(n):
                await stub.Check(health_pb2.HealthCheckRequest())

        await asyncio.gather(*(caller(calls // CALLERS) for _ in range(CALLERS)))


def _cpu_seconds(pid: int) -> float:
    stat = procstat.parse_pid_stat(pid, Path(f"/proc/{pid}/stat").read_text())
    return stat.jiffies / os.sysconf("SC_CLK_TCK")


def _arm(share: float | None, endpoint: str, calls: int) -> float:
    """The server's CPU µs a call for one arm, in a process of its own."""
    env = dict(os.environ)
    if share is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
        env["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        env["OTEL_TRACES_SAMPLER_ARG"] = str(share)
    port = free_port()
    argv = [sys.executable, "-m", "bench.grpc_tracing", "--serve", str(port)]
    if share is not None:
        argv.append("--traced")
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env) as server:
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("the server did not start")
            asyncio.run(_load(port, calls // 10))  # warm up
            time.sleep(EXPORT_PAUSE if share else 0)
            before = _cpu_seconds(server.pid)
            asyncio.run(_load(port, calls))
            time.sleep(EXPORT_PAUSE if share else 0)
            used = _cpu_seconds(server.pid) - before
        finally:
            server.kill()
    return used / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.grpc_tracing", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        asyncio.run(_serve(args.serve, args.traced))
        return 0
    results: dict[str, list[float]] = {name: [] for name in ARMS}
    with Receiver.running() as receiver:
        for _ in range(args.rounds):
            for name, share in ARMS.items():
                results[name].append(_arm(share, receiver.endpoint, args.calls))
    off = statistics.median(results["off"])
    for name, per_call in results.items():
        runs = ", ".join(f"{v:.1f}" for v in per_call)
        extra = "" if name == "off" else f" ({statistics.median(per_call) - off:+.1f} µs)"
        print(f"server CPU µs a call, tracing {name}: {runs}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
