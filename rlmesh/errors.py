"""Domain errors that services raise and the gRPC layer maps to status codes."""


class DomainError(Exception):
    """Base of errors a caller caused or can act on; the message says what was wrong."""


class InvalidArgument(DomainError):
    """The request itself is malformed or out of range."""


class NotFound(DomainError):
    """The request names something that does not exist (an instance, a batch)."""


class AlreadyExists(DomainError):
    """The request would create something that already exists."""


class FailedPrecondition(DomainError):
    """The request is well formed but the system is not in a state to accept it."""
