"""Value classes, target validation and the canonical form behind idempotency keys."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs

from dcache import TERMINAL

from ._errors import InvalidTargetsError

__all__ = [
    "MAX_CALLER_LENGTH",
    "MAX_DURATION",
    "MAX_KEY_LENGTH",
    "MAX_META_DEPTH",
    "MAX_OPTION_LENGTH",
    "MAX_URL_LENGTH",
    "Config",
    "Job",
    "Options",
    "Result",
    "Target",
    "TargetStatus",
    "canonical",
    "check_text",
    "client_idem_key",
    "encode_options",
    "idem_key",
    "idem_key_of",
    "normalize_targets",
    "payload_key",
]

MAX_URL_LENGTH = 8192
MAX_OPTION_LENGTH = 8192
MAX_CALLER_LENGTH = 191  # the store's key columns (utf8mb4 index limit on MySQL)
MAX_KEY_LENGTH = 255
MAX_DURATION = dt.timedelta(days=36500)  # any Config duration: a hundred years
MAX_META_DEPTH = 64  # nesting of a Result's meta; deeper fails the target (see Runner)

_STR_OPTIONS = ("mode", "question", "pages", "grep", "jq")
_BOOL_OPTIONS = ("context", "recover")
_TARGET_FIELDS = ("url", "options")


def check_text(value: object, what: str, *, limit: int, allow_empty: bool = False) -> str:
    """Return ``value`` if it is a string every backend can store, else raise ValueError.

    Rejects non-strings, empty strings (unless allowed), strings over ``limit``
    characters, NUL characters (PostgreSQL text cannot hold them) and lone surrogates
    (not encodable as UTF-8).
    """
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, not {type(value).__name__}")
    if not value and not allow_empty:
        raise ValueError(f"{what} must not be empty")
    if len(value) > limit:
        raise ValueError(f"{what} is {len(value)} characters long, at most {limit} allowed")
    if "\x00" in value:
        raise ValueError(f"{what} must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text ({exc.reason})") from None
    return value


@attrs.frozen
class Options:
    """Per-target options, passed through to ``fetch`` untouched."""

    mode: str = ""
    question: str = ""
    pages: str = ""
    grep: str = ""
    jq: str = ""
    context: bool = False
    recover: bool = False

    def to_json(self) -> dict[str, Any]:
        """The options as a JSON object with default-valued fields left out."""
        return {f: getattr(self, f) for f in (*_STR_OPTIONS, *_BOOL_OPTIONS) if getattr(self, f)}

    @classmethod
    def from_json(cls, obj: object) -> Options:
        """Parse a JSON object; raise :class:`InvalidTargetsError` naming the bad field."""
        if obj is None:
            return _DEFAULT_OPTIONS if cls is Options else cls()
        if not isinstance(obj, Mapping):
            raise InvalidTargetsError(
                f"options must be an object, not {type(obj).__name__}", field="options"
            )
        for key in obj:
            if key not in _STR_OPTIONS and key not in _BOOL_OPTIONS:
                raise InvalidTargetsError(
                    f"unknown option {key!r} (known: {', '.join(_STR_OPTIONS + _BOOL_OPTIONS)})",
                    field=f"options.{key}",
                )
        opts = cls(**dict(obj))
        opts.check()
        return opts

    def check(self) -> None:
        """Raise :class:`InvalidTargetsError` if a field has the wrong type or size."""
        for name in _STR_OPTIONS:
            try:
                check_text(
                    getattr(self, name),
                    f"options.{name}",
                    limit=MAX_OPTION_LENGTH,
                    allow_empty=True,
                )
            except ValueError as exc:
                raise InvalidTargetsError(str(exc), field=f"options.{name}") from None
        for name in _BOOL_OPTIONS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidTargetsError(
                    f"options.{name} must be a boolean, not {type(value).__name__}",
                    field=f"options.{name}",
                )


_DEFAULT_OPTIONS = Options()  # shared: Options are frozen


@attrs.frozen
class Target:
    """One unit of work: a URL and its options."""

    url: str
    options: Options = _DEFAULT_OPTIONS

    def to_json(self) -> dict[str, Any]:
        """``{"url": ..., "options": {...}}``; ``options`` left out when all default."""
        out: dict[str, Any] = {"url": self.url}
        if self.options is _DEFAULT_OPTIONS:
            return out  # most targets: no option to read
        opts = self.options.to_json()
        if opts:
            out["options"] = opts
        return out

    @classmethod
    def from_json(cls, obj: object) -> Target:
        """Parse ``{"url": ..., "options": {...}}``; raise :class:`InvalidTargetsError`."""
        if not isinstance(obj, Mapping):
            raise InvalidTargetsError(
                f"a target must be an object with a url, not {type(obj).__name__}"
            )
        for key in obj:
            if key not in _TARGET_FIELDS:
                raise InvalidTargetsError(
                    f"unknown field {key!r} in target (known: url, options)", field=str(key)
                )
        if "url" not in obj:
            raise InvalidTargetsError("target has no url", field="url")
        target = cls(url=obj["url"], options=Options.from_json(obj.get("options")))
        target._check_url()  # the options were checked as they were parsed
        return target

    def check(self) -> None:
        """Raise :class:`InvalidTargetsError` if the URL or an option is malformed."""
        self._check_url()
        if not isinstance(self.options, Options):
            raise InvalidTargetsError(
                f"options must be batch.Options, not {type(self.options).__name__}",
                field="options",
            )
        self.options.check()

    def _check_url(self) -> None:
        try:
            check_text(self.url, "url", limit=MAX_URL_LENGTH)
        except ValueError as exc:
            raise InvalidTargetsError(str(exc), field="url") from None
        if self.url.strip() != self.url:
            raise InvalidTargetsError("url has leading or trailing white space", field="url")


_OPTION_NAMES = (*_STR_OPTIONS, *_BOOL_OPTIONS)


def _same_as(target: Target) -> tuple[Any, ...]:
    """What makes two checked targets the same: their canonical forms are equal exactly
    when these are (the default values they leave out are the only false ones)."""
    opts = target.options
    if opts is _DEFAULT_OPTIONS:
        return (target.url, *_DEFAULT_SAME)  # most targets: nothing to read
    return (target.url, *[getattr(opts, name) for name in _OPTION_NAMES])


_DEFAULT_SAME = tuple(getattr(_DEFAULT_OPTIONS, name) for name in _OPTION_NAMES)


class Checked(tuple[Target, ...]):
    """Targets checked by :func:`normalize_targets`, sealed: ``Checked(items)`` checks
    ``items`` (raising as it does) and keeps what it returned; handed to it again (the HTTP
    view and the CLI check targets before they submit them), they are not checked twice.
    A tuple, so nothing can be added to it after the check."""

    __slots__ = ()

    def __new__(cls, items: object) -> Checked:
        return super().__new__(cls, normalize_targets(items))


def normalize_targets(items: object) -> list[Target]:
    """Turn a list of ``Target`` objects and/or JSON dicts into validated ``Target``s.

    Raises :class:`InvalidTargetsError` naming the index and field at fault: an empty or
    non-list value, an item that is neither, a bad URL or option, or a duplicate.
    """
    if type(items) is Checked and items:
        return list(items)  # checked already, and sealed since
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        raise InvalidTargetsError(f"targets must be a list of targets, not {type(items).__name__}")
    out: list[Target] = []
    seen: dict[tuple[Any, ...], int] = {}
    for i, item in enumerate(items):
        try:
            if isinstance(item, Target):
                item.check()
                target = item
            elif item.__class__ is dict and len(item) == 1 and "url" in item:
                # The usual JSON target, {"url": ...}: what from_json does, less the checks
                # of fields it does not have.
                target = Target(item["url"])
                target._check_url()
            else:
                target = Target.from_json(item)
        except InvalidTargetsError as exc:
            raise InvalidTargetsError(f"targets[{i}]: {exc}", index=i, field=exc.field) from None
        key = _same_as(target)
        if key in seen:
            raise InvalidTargetsError(
                f"targets[{i}] duplicates targets[{seen[key]}] ({target.url!r})", index=i
            )
        seen[key] = i
        out.append(target)
    if not out:
        raise InvalidTargetsError("targets must not be empty")
    return out


def _dumps(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def encode_options(options: Options) -> str:
    """The options as the store keeps them: their part of the canonical form."""
    if options is _DEFAULT_OPTIONS:
        return "{}"  # most targets: nothing to encode
    return _dumps(options.to_json())


def decode_options(text: str) -> Options:
    """Options as :func:`encode_options` stored them (all default if unreadable)."""
    if text == "{}":
        return _DEFAULT_OPTIONS  # most targets: nothing to decode
    try:
        return Options(**json.loads(text))
    except (TypeError, ValueError):
        return _DEFAULT_OPTIONS


def canonical(targets: Iterable[Target]) -> str:
    """The canonical JSON text of a target list, the input of :func:`idem_key`.

    UTF-8 JSON of ``[t.to_json() for t in targets]``: keys sorted, no white space,
    non-ASCII kept as is, default-valued options (and an all-default ``options``) left
    out. Keys are persisted, so this form must never change silently.
    """
    return _dumps([t.to_json() for t in targets])


def idem_key(caller: str, targets: Iterable[Target]) -> str:
    """``sha256(caller + "\\x00" + canonical(targets))`` as 64 hex digits."""
    return idem_key_of(caller, canonical(targets))


def idem_key_of(caller: str, canon: str) -> str:
    """:func:`idem_key` from a canonical form already computed."""
    return hashlib.sha256((caller + "\x00" + canon).encode("utf-8")).hexdigest()


def payload_key(canon: str) -> str:
    """``sha256(canonical form)``: what a job's targets are, whoever submitted them."""
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def client_idem_key(caller: str, key: str) -> str:
    """The idempotency key for a client-chosen key (HTTP ``Idempotency-Key``).

    ``sha256(caller + "\x00" + "idempotency-key:" + key)``: a canonical form always
    starts with ``[``, so this can never equal a content-derived key.
    """
    return hashlib.sha256((caller + "\x00idempotency-key:" + key).encode("utf-8")).hexdigest()


@attrs.frozen
class Result:
    """A completed target's outcome: its content and JSON-encodable metadata."""

    content: str
    meta: dict[str, Any] = attrs.field(factory=dict, hash=False)

    def to_json(self) -> dict[str, Any]:
        """``{"content": ..., "meta": {...}}``; ``meta`` left out when empty."""
        out: dict[str, Any] = {"content": self.content}
        if self.meta:
            out["meta"] = self.meta
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Result:
        """Rebuild a result stored by :meth:`to_json`."""
        return cls(content=obj.get("content", ""), meta=dict(obj.get("meta") or {}))


@attrs.frozen
class Job:
    """A job as callers see it."""

    id: str
    status: str
    error: str
    targets_total: int
    targets_done: int
    finished_at: dt.datetime | None
    caller: str = ""
    caller_class: str = ""
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    expires_at: dt.datetime | None = None
    owner: str = ""
    targets_failed: int = 0

    @property
    def terminal(self) -> bool:
        """Whether the status is final (done, failed, partial or cancelled)."""
        return self.status in TERMINAL

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, timestamps as ISO 8601 strings."""
        out = attrs.asdict(self)
        for key, value in out.items():
            if isinstance(value, dt.datetime):
                out[key] = value.isoformat()
        return out


@attrs.frozen
class TargetStatus:
    """One target of a job as callers see it."""

    idx: int
    url: str
    status: str
    result: Result | None
    error: str
    hint: str
    options: Options = _DEFAULT_OPTIONS
    # The stored result's size in UTF-8 bytes, when it was read without the result
    # (``Runner.status(job_id, results=False)``); None otherwise.
    result_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``"bytes"`` only when the result was left out)."""
        out = {
            "idx": self.idx,
            "url": self.url,
            "options": self.options.to_json(),
            "status": self.status,
            "result": self.result.to_json() if self.result is not None else None,
            "error": self.error,
            "hint": self.hint,
        }
        if self.result_bytes is not None:
            out["bytes"] = self.result_bytes
        return out


T = TypeVar("T")


def _positive_or_default(default: T) -> Callable[[Any], Any]:
    """A converter: 0 (or a zero timedelta) means the default; numbers become timedeltas."""

    def convert(value: Any) -> Any:
        if isinstance(default, dt.timedelta) and isinstance(value, (int, float)):
            if isinstance(value, bool):
                raise TypeError(f"expected a timedelta, not {value!r}")
            if not abs(value) <= MAX_DURATION.total_seconds():  # NaN or huge
                raise ValueError(
                    f"a duration must be a number of seconds up to "
                    f"{MAX_DURATION.total_seconds():.0f}, not {value!r}"
                )
            value = dt.timedelta(seconds=value)
        if not value:
            return default
        return value

    return convert


def _not_negative(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    zero: Any = dt.timedelta(0) if isinstance(value, dt.timedelta) else 0
    if isinstance(value, bool) or not isinstance(value, type(zero)):
        raise TypeError(f"Config.{attribute.name} must be {type(zero).__name__}, not {value!r}")
    if value < zero:
        raise ValueError(f"Config.{attribute.name} must not be negative, got {value!r}")
    # Durations are added to datetimes and handed to Event.wait(): bound them so neither
    # overflows (datetime.max, threading.TIMEOUT_MAX) at submit or in a thread.
    if isinstance(value, dt.timedelta) and value > MAX_DURATION:
        raise ValueError(f"Config.{attribute.name} must be at most {MAX_DURATION}, got {value!r}")


def _optional_duration(value: Any) -> Any:
    """``None`` or 0 stay unset; seconds become a timedelta (as the other durations)."""
    if value is None:
        return None
    value = _positive_or_default(dt.timedelta(0))(value)
    return value if value else None


def _not_negative_or_none(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _not_negative(inst, attribute, value)


def _field(default: Any) -> Any:
    return attrs.field(
        default=default, converter=_positive_or_default(default), validator=_not_negative
    )


@attrs.frozen
class Config:
    """Runner settings. A 0 means the default; a negative value is a ``ValueError``.

    Attributes:
        ttl: how long a job stays readable after its last write (timedelta or seconds).
        targets_per_job: most targets a job may have.
        jobs_per_caller: most live (queued/running) jobs one caller may have.
        jobs_total: most live jobs across all callers.
        heartbeat: how often a runner proves it is alive; its jobs are reaped as orphans
            after three missed beats.
        max_result_bytes: largest stored result (UTF-8 bytes of its JSON); larger fails.
        write_retry: how long a drain retries storing a fetched result through a
            database outage before it gives up (the result is never fetched again).
        purge_interval: least time between two purges of lapsed jobs (the runner's
            maintenance thread purges, in bounded batches, every heartbeat it is due;
            a purge that ran about a second and still found jobs to delete goes on at
            the next heartbeat).
        fetch_timeout: when set, a ``fetch`` that has not returned within it fails its
            target with ``"FetchTimeout: no result within N s"`` and the drain goes on;
            a late result is discarded, never stored. ``None`` (the default, also 0):
            wait as long as ``fetch`` takes.
    """

    ttl: dt.timedelta = _field(dt.timedelta(hours=24))
    targets_per_job: int = _field(32)
    jobs_per_caller: int = _field(1)
    jobs_total: int = _field(8)
    heartbeat: dt.timedelta = _field(dt.timedelta(seconds=10))
    max_result_bytes: int = _field(8 * 1024 * 1024)
    write_retry: dt.timedelta = _field(dt.timedelta(seconds=60))
    purge_interval: dt.timedelta = _field(dt.timedelta(seconds=60))
    fetch_timeout: dt.timedelta | None = attrs.field(
        default=None, converter=_optional_duration, validator=_not_negative_or_none
    )
