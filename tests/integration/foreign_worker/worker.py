"""A worker that knows jobplane only by docs/workers.md.

It imports nothing of jobplane: the WorkerService stubs are generated from
proto/ at test time into a directory of their own (``--stubs``, as the
``workerapi`` package), and it speaks AMQP with aiormq. It runs as its own
process, and every line it prints is a JSON object the test reads; each
settled message reports the ``jobplane`` modules loaded so far (none).

It registers the job types it runs (``--types``), renews the registration
while it runs and stops it at the end; a delivered job of another type is
handed back. What a job does is its payload's ``mode``: ``succeed`` (progress, then a
result), ``flaky`` (a retryable failure on attempt 1, then success),
``fail`` (a permanent failure), ``wait_cancel`` (heartbeats until a cancel
is requested, then reports it cancelled).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from typing import Any

import aiormq
import aiormq.abc
import grpc
from google.protobuf import duration_pb2, json_format, struct_pb2

parser = argparse.ArgumentParser()
parser.add_argument("--address", required=True)
parser.add_argument("--amqp-url", required=True)
parser.add_argument("--queue", required=True)
parser.add_argument("--stubs", required=True)
parser.add_argument("--types", required=True, help="the job types it runs, comma-separated")
ARGS = parser.parse_args()
sys.path.insert(0, ARGS.stubs)

from workerapi import workers_pb2, workers_pb2_grpc  # type: ignore[import-not-found]  # noqa: E402

Claim = workers_pb2.ClaimJobResponse


def say(event: str, **fields: Any) -> None:
    """One line for the test."""
    print(json.dumps({"event": event, **fields}, sort_keys=True), flush=True)


def loaded_jobplane_modules() -> list[str]:
    return sorted(name for name in sys.modules if name.split(".")[0] == "jobplane")


def struct(value: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


def reason(error: grpc.aio.AioRpcError) -> str:
    """The ErrorInfo reason of a refused call (the rich status's details)."""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            from google.rpc import error_details_pb2, status_pb2

            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return str(info.reason)
    return ""


def bad_field(error: grpc.aio.AioRpcError) -> str:
    """The field an INVALID_ARGUMENT names (its BadRequest detail); "" for other answers."""
    if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return ""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            from google.rpc import error_details_pb2, status_pb2

            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                bad = error_details_pb2.BadRequest()
                if detail.Unpack(bad) and bad.field_violations:
                    return str(bad.field_violations[0].field)
    return ""


class ForeignWorker:
    def __init__(
        self, stub: Any, key: str, channel: aiormq.abc.AbstractChannel, types: list[str]
    ) -> None:
        self._stub = stub
        self._metadata = (("authorization", f"Bearer {key}"),)
        self._channel = channel
        self._types = types
        self._tasks: set[asyncio.Task[None]] = set()
        self.name = ""

    async def register(self) -> float:
        """Register; how often to renew."""
        reply = await self._call(
            "RegisterWorker",
            workers_pb2.RegisterWorkerRequest(
                types=self._types,
                queues=[ARGS.queue],
                concurrency=4,
                host="foreign",
                pid=os.getpid(),
                version="foreign-worker/1",
            ),
        )
        self.name = reply.name
        say("registered", name=self.name)
        return float(reply.renew_interval.ToTimedelta().total_seconds())

    async def keep_registered(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self._call("RenewWorker", workers_pb2.RenewWorkerRequest(name=self.name))
            except grpc.aio.AioRpcError as exc:
                if reason(exc) == "WORKER_NOT_FOUND":
                    await self.register()
                else:
                    say("renew_failed", code=exc.code().name)

    async def stop(self) -> None:
        await self._call("StopWorker", workers_pb2.StopWorkerRequest(name=self.name))

    async def on_message(self, message: aiormq.abc.DeliveredMessage) -> None:
        task = asyncio.create_task(self._settled(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settled(self, message: aiormq.abc.DeliveredMessage) -> None:
        tag = message.delivery_tag
        assert tag is not None
        try:
            settle = await self._handle(message)
        except Exception as exc:  # the message comes back: a crash of ours is not the job's
            say("crashed", error=repr(exc))
            await self._channel.basic_nack(tag, requeue=True)
            return
        if settle == "ack":
            await self._channel.basic_ack(tag)
        elif settle == "requeue":
            await self._channel.basic_nack(tag, requeue=True)
        else:
            await self._channel.basic_reject(tag, requeue=False)
        say("settled", settle=settle, jobplane_modules=loaded_jobplane_modules())

    async def _call(self, method: str, request: Any) -> Any:
        return await getattr(self._stub, method)(request, metadata=self._metadata, timeout=10)

    async def _handle(self, message: aiormq.abc.DeliveredMessage) -> str:
        try:
            return await self._handle_message(message)
        except grpc.aio.AioRpcError as exc:
            if bad_field(exc) != "message_body":
                raise
            # The message itself is malformed: no retry changes that. It goes
            # to the failed queue for an operator, not back to the queue.
            say("malformed", details=exc.details())
            return "reject"

    async def _handle_message(self, message: aiormq.abc.DeliveredMessage) -> str:
        # The type is the routing key (and the body's `type`): no claim without a handler.
        if message.routing_key not in self._types:
            back = await self._call(
                "HandBackJob", workers_pb2.HandBackJobRequest(message_body=message.body)
            )
            status = workers_pb2.HandBackJobResponse.Status.Name(back.status)
            say("handed_back", status=status, type=message.routing_key)
            if back.status == workers_pb2.HandBackJobResponse.STATUS_NOT_FOUND:
                return "reject"
            if back.status == workers_pb2.HandBackJobResponse.STATUS_OTHER_DEPLOYMENT:
                return "requeue"
            return "ack"
        while True:
            claim = await self._call(
                "ClaimJob", workers_pb2.ClaimJobRequest(message_body=message.body)
            )
            status = Claim.Status.Name(claim.status)
            say("claim", status=status, job=claim.attempt.job, attempt=claim.attempt.attempt)
            if claim.status == Claim.STATUS_CLAIMED:
                await self._run(claim)
                return "ack"
            if claim.status == Claim.STATUS_IN_FLIGHT and message.redelivered:
                await asyncio.sleep(claim.retry_after.ToTimedelta().total_seconds())
                continue
            if claim.status == Claim.STATUS_NOT_FOUND:
                return "reject"
            if claim.status == Claim.STATUS_OTHER_DEPLOYMENT:
                return "requeue"
            return "ack"  # finished, stale, exhausted, or a copy of a message in flight

    async def _run(self, claim: Any) -> None:
        ref = claim.attempt
        payload = json_format.MessageToDict(claim.payload)
        mode = payload.get("mode", "succeed")
        try:
            if mode == "flaky" and ref.attempt == 1:
                await self._fail(ref, retryable=True, delay=0.05)
            elif mode == "fail":
                await self._fail(ref, retryable=False)
            elif mode == "wait_cancel":
                await self._until_cancelled(ref)
            else:
                await self._succeed(ref, payload)
        except grpc.aio.AioRpcError as exc:
            if reason(exc) != "LEASE_LOST":
                raise
            # Another attempt owns the job now: nothing of ours counts; ack.
            say("lease_lost", job=ref.job)

    async def _succeed(self, ref: Any, payload: dict[str, Any]) -> None:
        steps = int(payload.get("steps", 3))
        for step in range(1, steps):
            reply = await self._call(
                "ReportProgress",
                workers_pb2.ReportProgressRequest(
                    attempt=ref,
                    reports=[workers_pb2.Progress(progress=step / steps, message=f"step {step}")],
                ),
            )
            if reply.cancel_requested:
                await self._call("ReportCancelled", workers_pb2.ReportCancelledRequest(attempt=ref))
                return
        last = workers_pb2.Progress(
            progress=1.0, message=f"step {steps}", data=struct({"n": steps})
        )
        result = {"echo": payload, "attempt": ref.attempt, "worker": "foreign"}
        await self._call(
            "CompleteJob",
            workers_pb2.CompleteJobRequest(attempt=ref, result=struct(result), reports=[last]),
        )
        say("completed", job=ref.job, attempt=ref.attempt)

    async def _fail(self, ref: Any, *, retryable: bool, delay: float | None = None) -> None:
        request = workers_pb2.FailJobRequest(
            attempt=ref, code="FOREIGN_FAILURE", message="it broke", retryable=retryable
        )
        if delay is not None:
            request.retry_delay.CopyFrom(duration_pb2.Duration(nanos=int(delay * 1e9)))
        reply = await self._call("FailJob", request)
        say("failed", job=ref.job, attempt=ref.attempt, retry_scheduled=reply.retry_scheduled)

    async def _until_cancelled(self, ref: Any) -> None:
        while True:
            beat = await self._call("Heartbeat", workers_pb2.HeartbeatRequest(attempt=ref))
            if beat.cancel_requested:
                say("cancel_seen", job=ref.job)
                await self._call("ReportCancelled", workers_pb2.ReportCancelledRequest(attempt=ref))
                say("cancelled", job=ref.job)
                return
            await asyncio.sleep(0.1)


async def main() -> None:
    key = os.environ["FOREIGN_WORKER_KEY"]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with grpc.aio.insecure_channel(ARGS.address) as rpc:
        connection = await aiormq.connect(ARGS.amqp_url)
        try:
            channel = await connection.channel()
            await channel.basic_qos(prefetch_count=4)
            worker = ForeignWorker(
                workers_pb2_grpc.WorkerServiceStub(rpc), key, channel, ARGS.types.split(",")
            )
            # Registered before consuming: others park a type only no live worker runs.
            renew = asyncio.create_task(worker.keep_registered(await worker.register()))
            await channel.basic_consume(ARGS.queue, worker.on_message, no_ack=False)
            say("started", jobplane_modules=loaded_jobplane_modules())
            await stop.wait()
            renew.cancel()
            await worker.stop()
        finally:
            with contextlib.suppress(Exception):
                await connection.close()
    say("stopped")


if __name__ == "__main__":
    asyncio.run(main())
