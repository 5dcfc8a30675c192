"""batch: persistent, serial batch jobs for web apps and scripts.

Submit up to 32 targets as a job; one daemon thread drains them in order through an
injected ``fetch(target) -> Result`` and stores each outcome the moment it completes.
"""

from __future__ import annotations

from dcache import StoreError, StoreUnavailableError

from . import events
from ._errors import (
    BusyError,
    CallerBusyError,
    FetchError,
    IdempotencyKeyMismatchError,
    InvalidTargetsError,
    RunnerClosedError,
    SubmitError,
    TooManyTargetsError,
)
from ._runner import Fetch, RawStatus, Runner, new_job_id
from ._values import (
    Config,
    Job,
    Options,
    Result,
    Target,
    TargetStatus,
    canonical,
    client_idem_key,
    idem_key,
    normalize_targets,
)
from ._webhooks import SCHEDULE as WEBHOOK_SCHEDULE
from ._webhooks import Webhooks, sign

__all__ = [
    "WEBHOOK_SCHEDULE",
    "BusyError",
    "CallerBusyError",
    "Config",
    "Fetch",
    "FetchError",
    "IdempotencyKeyMismatchError",
    "InvalidTargetsError",
    "Job",
    "Options",
    "RawStatus",
    "Result",
    "Runner",
    "RunnerClosedError",
    "StoreError",
    "StoreUnavailableError",
    "SubmitError",
    "Target",
    "TargetStatus",
    "TooManyTargetsError",
    "Webhooks",
    "canonical",
    "client_idem_key",
    "events",
    "idem_key",
    "new_job_id",
    "normalize_targets",
    "sign",
]
