"""The runner's exceptions. Each submit error carries its HTTP status as ``http_status``."""

from __future__ import annotations

from dcache import StoreError, StoreUnavailableError

__all__ = [
    "BusyError",
    "CallerBusyError",
    "FetchError",
    "IdempotencyKeyMismatchError",
    "InvalidTargetsError",
    "RunnerClosedError",
    "StoreError",
    "StoreUnavailableError",
    "SubmitError",
    "TooManyTargetsError",
]


class SubmitError(Exception):
    """A submission was refused; ``http_status`` is the status an HTTP layer should send."""

    http_status: int = 400


class InvalidTargetsError(SubmitError, ValueError):
    """The target list is malformed; the message names the index and field at fault."""

    http_status = 422

    def __init__(self, message: str, *, index: int | None = None, field: str | None = None):
        super().__init__(message)
        self.index = index
        self.field = field


class TooManyTargetsError(SubmitError):
    """The job has more targets than ``Config.targets_per_job`` allows; split it."""

    http_status = 422

    def __init__(self, count: int, limit: int):
        super().__init__(f"too many targets: {count} given, at most {limit} per job")
        self.count = count
        self.limit = limit


class CallerBusyError(SubmitError):
    """The caller already has ``jobs_per_caller`` live jobs; wait for one to finish."""

    http_status = 429

    def __init__(self, caller: str, live: int, limit: int):
        super().__init__(
            f"caller {caller!r} is busy: {live} live job(s), at most {limit}; "
            "wait for one to finish or cancel it"
        )
        self.caller = caller
        self.live = live
        self.limit = limit


class BusyError(SubmitError):
    """``jobs_total`` jobs are live across all callers; retry later."""

    http_status = 429

    def __init__(self, live: int, limit: int):
        super().__init__(f"busy: {live} live job(s) in all, at most {limit}; retry later")
        self.live = live
        self.limit = limit


class IdempotencyKeyMismatchError(SubmitError):
    """The idempotency key was already used for different targets; use a new key."""

    http_status = 422

    def __init__(self, key: str):
        super().__init__(
            f"idempotency key {key!r} was already used with different targets; "
            "use a new key for a new job"
        )
        self.key = key


class RunnerClosedError(SubmitError, RuntimeError):
    """The runner was closed and takes no more submissions; submit to a running one."""

    http_status = 503


class FetchError(Exception):
    """Raised by a ``fetch`` to fail its target with a message and an optional hint."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = "" if hint is None else hint
