"""One exception tree for server, workers and SDK.

Each error has a canonical gRPC code and a stable ``google.rpc.ErrorInfo``
reason. The server turns an error into a status with :data:`ERROR_DOMAIN`; the
SDK turns the status back into the same class (see :func:`error_for_reason`).
An error with a ``retry_delay`` also carries ``google.rpc.RetryInfo``.
"""

from __future__ import annotations

import grpc

ERROR_DOMAIN = "jobplane.dev"

# How much of a caller's value an error message repeats: enough to recognise
# it, never enough to push the reply past the client's metadata limit (8 KiB
# by default, and grpc-message is percent-encoded).
SHOWN_CHARACTERS = 64


def shown(value: object, limit: int = SHOWN_CHARACTERS) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 1]}…({len(str(value))} characters)"


class JobplaneError(Exception):
    """A jobplane call failed."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    reason: str = "UNKNOWN"

    def __init__(
        self,
        message: str | None = None,
        *,
        field: str | None = None,
        metadata: dict[str, str] | None = None,
        retry_delay: float | None = None,
    ) -> None:
        self.message = message or (type(self).__doc__ or type(self).__name__).strip()
        self.field = field
        self.metadata = dict(metadata or {})
        #: Seconds the server asks the caller to wait before trying again
        #: (``google.rpc.RetryInfo``); None when it said nothing.
        self.retry_delay = retry_delay
        super().__init__(self.message)


def at_item(error: JobplaneError, index: int, items: str = "requests") -> JobplaneError:
    """``error`` of the item at ``index`` of a batch: the same class, reason and
    metadata, its field under the item's path (``requests[3].payload``,
    ``requests[3]`` for a field-less error) and ``metadata["index"]``."""
    path = f"{items}[{index}]"
    return type(error)(
        f"{path}: {error.message}",
        field=f"{path}.{error.field}" if error.field else path,
        metadata={**error.metadata, "index": str(index)},
        retry_delay=error.retry_delay,
    )


class InvalidArgument(JobplaneError):
    """The request is not valid."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class MalformedRequest(InvalidArgument):
    """The request body is not a valid message of the call."""

    reason = "MALFORMED_REQUEST"


class PayloadTooLarge(InvalidArgument):
    """The job payload is larger than the server accepts."""

    reason = "PAYLOAD_TOO_LARGE"


class UnroutableJobType(InvalidArgument):
    """No queue of the topology takes this job type."""

    reason = "JOB_TYPE_UNROUTABLE"


class BlobTooLarge(InvalidArgument):
    """The blob is larger than the server accepts (JOBPLANE_MAX_BLOB_BYTES)."""

    reason = "BLOB_TOO_LARGE"


class DigestMismatch(InvalidArgument):
    """The blob's bytes do not have the declared sha256; nothing was stored."""

    reason = "DIGEST_MISMATCH"


class BlobReferenceNotFound(InvalidArgument):
    """The payload names a blob the caller has none of (the SDK raises BlobNotFound)."""

    reason = "BLOB_NOT_FOUND"


class BlobSizeMismatch(InvalidArgument):
    """The blob's bytes are not of the declared size; nothing was stored."""

    reason = "BLOB_SIZE_MISMATCH"


class Unauthenticated(JobplaneError):
    """The call has no valid API key."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class PermissionDenied(JobplaneError):
    """The API key may not make this call."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class KeyScopeMismatch(PermissionDenied):
    """The API key is of the wrong scope for this service: a worker key calls
    WorkerService only, a tenant key every other service."""

    reason = "KEY_SCOPE_MISMATCH"


class JobNotFound(JobplaneError):
    """No job with this name."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "JOB_NOT_FOUND"


class ScheduleNotFound(JobplaneError):
    """No such schedule (for this tenant)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "SCHEDULE_NOT_FOUND"


class ScheduleExists(JobplaneError):
    """The tenant has a schedule of that id already."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "SCHEDULE_EXISTS"


class BlobNotFound(JobplaneError):
    """No blob with this name."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "BLOB_NOT_FOUND"


class WorkerNotFound(JobplaneError):
    """No live worker registration with this name; register again."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "WORKER_NOT_FOUND"


class TenantNotFound(JobplaneError):
    """No tenant has this name (from ``jobplane.submit_job``, which names tenants)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "TENANT_NOT_FOUND"


class RequestIdReused(JobplaneError):
    """This request_id was already used for a different request."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "REQUEST_ID_REUSED"


class EventIdReused(JobplaneError):
    """This event_id was already published with a different event."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "EVENT_ID_REUSED"


class FailedPrecondition(JobplaneError):
    """The job is not in a state that allows this call."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class JobAlreadyTerminal(FailedPrecondition):
    """The job has already ended."""

    reason = "JOB_TERMINAL"


class JobNotRetryable(FailedPrecondition):
    """Only FAILED or CANCELLED jobs can be retried."""

    reason = "JOB_NOT_RETRYABLE"


class ParentWaiting(FailedPrecondition):
    """The job is a child of a fan-out whose job still waits for its children:
    retry that job once it has ended (it runs the failed children again).
    ``metadata``: ``parent``, the waiting job (``jobs/{id}``)."""

    reason = "PARENT_WAITING"


class AttemptLeaseLost(FailedPrecondition):
    """This attempt no longer holds the job's lease; nothing was written."""

    reason = "LEASE_LOST"


class CancelNotRequested(FailedPrecondition):
    """Cancellation of this job was not requested; the attempt cannot end CANCELLED."""

    reason = "CANCEL_NOT_REQUESTED"


class BlobInUse(FailedPrecondition):
    """A job references this blob; delete the job (or wait for its retention) first."""

    reason = "BLOB_IN_USE"


class BlobsDisabled(FailedPrecondition):
    """This deployment has no object store (JOBPLANE_S3_URL is not set)."""

    reason = "BLOBS_DISABLED"


class ConcurrencyLimitReached(JobplaneError):
    """The job's concurrency key already has its limit of jobs in flight (QUEUED or
    RUNNING), and the job asked to be refused rather than wait (reject mode).

    ABORTED (HTTP 409). ``metadata``: ``concurrency_key``, ``concurrency_limit``
    and ``holders``, the jobs in flight (``jobs/{id}``, comma-separated);
    :attr:`holders` lists them. Nothing was written.
    """

    code = grpc.StatusCode.ABORTED
    reason = "CONCURRENCY_LIMIT_REACHED"

    @property
    def holders(self) -> list[str]:
        """The jobs holding the key (``jobs/{id}``), oldest first."""
        return [name for name in self.metadata.get("holders", "").split(",") if name]


class ResourceExhausted(JobplaneError):
    """A limit was reached; the call may succeed later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"


class TenantLimitExceeded(ResourceExhausted):
    """The tenant is over one of its limits; retry after ``retry_delay`` seconds.

    ``metadata["limit"]`` names the limit (``watch_streams`` or
    ``submits_per_second``) and ``metadata["max"]`` its value.
    """

    reason = "TENANT_LIMIT_EXCEEDED"

    @property
    def limit(self) -> str:
        """Which limit was reached."""
        return self.metadata.get("limit", "")


class ChildLimitReached(ResourceExhausted):
    """A job has as many child jobs as one job may have (``metadata["max"]``)."""

    reason = "CHILD_LIMIT_REACHED"


class Unavailable(JobplaneError):
    """The service is not available right now; the call may be retried."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


class BlobStoreUnavailable(Unavailable):
    """The object store is not reachable right now; the call may be retried."""

    reason = "BLOB_STORE_UNAVAILABLE"


class Aborted(JobplaneError):
    """The call's transaction conflicted with another one at the same moment (a
    deadlock, a serialization failure) and was rolled back: nothing was
    written, and the same call most likely passes when repeated."""

    code = grpc.StatusCode.ABORTED
    reason = "ABORTED"


class InternalError(JobplaneError):
    """The server failed to handle the call."""

    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"


_BY_REASON: dict[str, type[JobplaneError]] = {
    cls.reason: cls
    for cls in (
        InvalidArgument,
        MalformedRequest,
        PayloadTooLarge,
        UnroutableJobType,
        BlobTooLarge,
        DigestMismatch,
        BlobSizeMismatch,
        BlobNotFound,
        BlobInUse,
        BlobsDisabled,
        BlobStoreUnavailable,
        Unauthenticated,
        PermissionDenied,
        KeyScopeMismatch,
        JobNotFound,
        ScheduleNotFound,
        ScheduleExists,
        WorkerNotFound,
        TenantNotFound,
        RequestIdReused,
        EventIdReused,
        FailedPrecondition,
        JobAlreadyTerminal,
        JobNotRetryable,
        ParentWaiting,
        AttemptLeaseLost,
        CancelNotRequested,
        ResourceExhausted,
        TenantLimitExceeded,
        ChildLimitReached,
        Unavailable,
        InternalError,
        ConcurrencyLimitReached,
        Aborted,
    )
}

_BY_CODE: dict[grpc.StatusCode, type[JobplaneError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: JobNotFound,
    grpc.StatusCode.ALREADY_EXISTS: RequestIdReused,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.INTERNAL: InternalError,
}


def error_for_reason(reason: str | None, code: grpc.StatusCode) -> type[JobplaneError]:
    """The exception class for an ErrorInfo reason, else for the status code."""
    if reason and reason in _BY_REASON:
        return _BY_REASON[reason]
    return _BY_CODE.get(code, JobplaneError)
