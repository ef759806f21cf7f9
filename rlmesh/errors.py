"""Domain errors that services raise and the gRPC layer maps to status codes."""

MAX_MESSAGE_BYTES = 1500
"""The longest message an error keeps, in UTF-8 bytes. gRPC sends it percent-encoded (up to three
times longer) in a trailer that clients refuse past 8 KiB: a message quoting a huge request field
would reach the caller as RESOURCE_EXHAUSTED "Stream removed" instead of its own status."""


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message`, or its beginning and end with what was cut between them when it is too long."""
    raw = message.encode()
    if len(raw) <= limit:
        return message
    half = limit // 2
    head, tail = raw[:half].decode(errors="ignore"), raw[-half:].decode(errors="ignore")
    return f"{head} [...{len(raw) - 2 * half} bytes cut...] {tail}"


class DomainError(Exception):
    """Base of errors a caller caused or can act on; the message says what was wrong."""

    def __init__(self, message: str = "") -> None:
        super().__init__(bounded(message))


class InvalidArgument(DomainError):
    """The request itself is malformed or out of range."""


class NotFound(DomainError):
    """The request names something that does not exist (an instance, a batch)."""


class AlreadyExists(DomainError):
    """The request would create something that already exists."""


class FailedPrecondition(DomainError):
    """The request is well formed but the system is not in a state to accept it."""


class PermissionDenied(DomainError):
    """The caller may not do this here (a request dispatched to another incarnation of an instance)."""


class Aborted(DomainError):
    """The request lost to a concurrent change of state; the caller may retry it at a higher level,
    e.g. elsewhere (an instance asked to generate with a weight version it is moving on from)."""


class OutOfRange(DomainError):
    """The request names something outside what the system can still provide (a weight version
    no instance serves any more)."""


class Unavailable(DomainError):
    """Something the request depends on cannot be reached now; the same call may succeed later."""
