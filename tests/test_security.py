"""Security: unguessable job ids, bounded inputs, and hostile strings that stay inert.

Job ids are the only secret a job has: they must carry at least 128 bits from
:mod:`secrets` and never repeat. Every input a stranger controls has a bound with a clear
error (URL, option, caller and key lengths, number of targets, result size). And strings
built to hurt (SQL fragments, NUL bytes, lone surrogates, bidi controls, emoji, very long
text) used as ids, callers, URLs, options or results are inert on every backend: each is
either refused cleanly (``InvalidTargetsError``, ``None``, ``False``) or stored and read
back exactly; never a ``StoreError``, never a crash. The HTTP-specific items (ownership
404s, request body bounds) live with the Flask tests.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

import batch
import dcache
from batch import InvalidTargetsError, Options, Result, Target
from batch._values import MAX_CALLER_LENGTH, MAX_KEY_LENGTH, MAX_OPTION_LENGTH, MAX_URL_LENGTH

WAIT = 30.0
ID = re.compile(r"[0-9a-f]{32}")
STR_OPTIONS = ("mode", "question", "pages", "grep", "jq")

HOSTILE = [
    # SQL and template fragments
    "' OR '1'='1",
    "'; DROP TABLE batch_job; --",
    '" OR ""="',
    "1; SELECT pg_sleep(10); --",
    "x' UNION SELECT id FROM batch_job --",
    "%",
    "_",
    "%' OR caller LIKE '%",
    "\\",
    "\\'",
    "$1",
    ":id",
    "?",
    "{{7*7}}",
    "${jndi:ldap://127.0.0.1/a}",
    "<script>alert(1)</script>",
    "../../etc/passwd",
    # bytes and code points that break naive storage
    "\x00",
    "a\x00b",
    "\ud800",
    "\udfff",
    "a\udc80b",
    "\x01\x02\x1b[31m",
    "\x7f",
    # invisible and direction-changing characters
    "\u202etxt.exe",
    "\u200f\u200e",
    "\ufeff",
    "a\u200bb",
    "e\u0301",
    "\u2028",
    # emoji and astral planes
    "\U0001f600",
    "\U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "\U0010ffff",
    "\U0001d54f" * 191,
    # white space
    " leading",
    "trailing ",
    "\t",
    "\r\n",
    "   ",
    "",
    # very long unicode
    "\u4e2d\u6587" * 95,
    "\u00e9" * 5000,
    "\U0001f600" * 9000,
]


def storable(value: str, limit: int) -> bool:
    """What every backend can hold: non-empty text within the limit, no NUL, valid UTF-8."""
    if not value or len(value) > limit or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_url(value: str) -> bool:
    return storable(value, MAX_URL_LENGTH) and value.strip() == value


def hid(value: str) -> str:
    """A short printable name for a hostile string (for assertion messages)."""
    return ascii(value[:24]) + (f"...({len(value)})" if len(value) > 24 else "")


class EchoFetch:
    """A fetch that records each target it receives and returns a result naming it."""

    def __init__(self) -> None:
        self.seen: list[Target] = []
        self._lock = threading.Lock()

    def __call__(self, target: Target) -> Result:
        with self._lock:
            self.seen.append(target)
        return Result(f"fetched {target.url}", {"url": target.url})


@pytest.fixture
def runner(db: dcache.DB) -> Iterator[batch.Runner]:
    """A runner on every backend with room for many callers at once."""
    r = batch.Runner(
        db,
        EchoFetch(),
        batch.Config(jobs_total=10_000, jobs_per_caller=10_000, heartbeat=dt.timedelta(hours=1)),
    )
    try:
        yield r
    finally:
        r.close(timeout=WAIT)


def finished(runner: batch.Runner, job_id: str) -> batch.Job:
    job = runner.wait(job_id, timeout=WAIT)
    assert job is not None
    return job


# -- job ids -------------------------------------------------------------------------------


def test_job_ids_are_32_lowercase_hex_and_never_repeat_over_100k() -> None:
    """An id is the key to a job's results: it must be long, uniform and never reused."""
    ids = [batch.new_job_id() for _ in range(100_000)]
    assert all(ID.fullmatch(i) for i in ids), next(i for i in ids if not ID.fullmatch(i))
    assert len(set(ids)) == len(ids)
    # Every position takes every hex digit, roughly evenly: no fixed, time or counter part.
    for pos in range(32):
        counts = Counter(i[pos] for i in ids)
        assert len(counts) == 16, pos
        assert min(counts.values()) > 100_000 / 16 * 0.9, (pos, counts)


def test_job_ids_draw_128_bits_from_secrets_not_from_random(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeding ``random`` must not make ids predictable: they come from the OS CSPRNG."""
    drawn: list[int] = []
    real = secrets.token_hex

    def spy(nbytes: int | None = None) -> str:
        drawn.append(nbytes or 32)
        return real(nbytes)

    monkeypatch.setattr(secrets, "token_hex", spy)
    random.seed(7)
    first = batch.new_job_id()
    random.seed(7)
    second = batch.new_job_id()
    assert first != second
    assert drawn and all(n >= 16 for n in drawn), drawn


def test_submitted_jobs_get_such_ids(db: dcache.DB) -> None:
    """The ids callers see are the secret kind, on every backend."""
    r = batch.Runner(db, EchoFetch(), batch.Config(jobs_per_caller=4))
    try:
        ids = [r.submit(f"c{i}", "user", [Target(f"https://e.example/{i}")])[0] for i in range(4)]
        for job_id in ids:
            finished(r, job_id)
    finally:
        r.close(timeout=WAIT)
    assert all(ID.fullmatch(i) for i in ids) and len(set(ids)) == 4


def test_a_guessed_id_finds_nothing(runner: batch.Runner) -> None:
    """Ids next to a real one (one digit off, a prefix, upper case) must not reach it."""
    job_id, _ = runner.submit("alice", "user", [Target("https://e.example/x")])
    finished(runner, job_id)
    flipped = job_id[:-1] + ("0" if job_id[-1] != "0" else "1")
    for guess in (flipped, job_id[:16], job_id.upper(), job_id + "0", f" {job_id}", f"{job_id} "):
        assert runner.status(guess) is None, guess
        assert runner.job(guess) is None, guess
        assert runner.cancel(guess) is False, guess
    assert runner.status(job_id) is not None


# -- bounded inputs ------------------------------------------------------------------------


def test_url_length_is_bounded_with_a_clear_error(runner: batch.Runner) -> None:
    """A megabyte URL must be refused up front, saying which field and what the limit is."""
    base = "https://e.example/"
    ok = base + "u" * (MAX_URL_LENGTH - len(base))
    job_id, _ = runner.submit("alice", "user", [Target(ok)])
    assert finished(runner, job_id).status == "done"
    with pytest.raises(InvalidTargetsError) as info:
        runner.submit("alice", "user", [Target(ok + "u")])
    assert info.value.field == "url" and info.value.index == 0
    assert f"at most {MAX_URL_LENGTH}" in str(info.value)
    assert info.value.http_status == 422


@pytest.mark.parametrize("name", STR_OPTIONS)
def test_option_lengths_are_bounded_with_a_clear_error(runner: batch.Runner, name: str) -> None:
    """Options pass through to fetch untouched, so each must have a size limit of its own."""
    ok = Options(**{name: "o" * MAX_OPTION_LENGTH})
    job_id, _ = runner.submit("alice", "user", [Target("https://e.example/o", ok)])
    found = runner.status(job_id)
    assert found is not None and found[1][0].options == ok
    finished(runner, job_id)
    too_long = {"url": "https://e.example/o", "options": {name: "o" * (MAX_OPTION_LENGTH + 1)}}
    with pytest.raises(InvalidTargetsError) as info:
        runner.submit("alice", "user", [too_long])
    assert info.value.field == f"options.{name}"
    assert f"at most {MAX_OPTION_LENGTH}" in str(info.value)


@pytest.mark.parametrize("field", ["caller", "caller_class"])
def test_caller_length_is_bounded_with_a_clear_error(runner: batch.Runner, field: str) -> None:
    """Callers are index keys; an unbounded one would fail deep in the store instead."""
    longest = "\U0001f600" * MAX_CALLER_LENGTH  # 4-byte characters: the worst case on MySQL
    args = {"caller": "alice", "caller_class": "user", field: longest}
    job_id, _ = runner.submit(args["caller"], args["caller_class"], [Target("https://e.example")])
    job = finished(runner, job_id)
    assert getattr(job, field) == longest
    args[field] = longest + "x"
    with pytest.raises(InvalidTargetsError) as info:
        runner.submit(args["caller"], args["caller_class"], [Target("https://e.example")])
    assert info.value.field == field
    assert f"at most {MAX_CALLER_LENGTH}" in str(info.value)


def test_idempotency_key_length_is_bounded_with_a_clear_error(runner: batch.Runner) -> None:
    """A client-chosen key is stored only as a hash, but its length is still bounded."""
    job_id, _ = runner.submit(
        "alice", "user", [Target("https://e.example")], idempotency_key="k" * MAX_KEY_LENGTH
    )
    finished(runner, job_id)
    with pytest.raises(InvalidTargetsError) as info:
        runner.submit(
            "alice",
            "user",
            [Target("https://e.example/2")],
            idempotency_key="k" * (MAX_KEY_LENGTH + 1),
        )
    assert info.value.field == "idempotency_key"


def test_number_of_targets_is_bounded_with_a_clear_error(db: dcache.DB) -> None:
    """A job of 10 000 targets is refused quickly with the count and the limit, before any work."""
    fetch = EchoFetch()
    r = batch.Runner(db, fetch, batch.Config(targets_per_job=32))
    try:
        job_id, _ = r.submit("alice", "user", [Target(f"https://e.example/{i}") for i in range(32)])
        assert finished(r, job_id).targets_done == 32
        for n in (33, 10_000):
            t0 = time.monotonic()
            with pytest.raises(batch.TooManyTargetsError) as info:
                r.submit("bob", "user", [Target(f"https://e.example/{i}") for i in range(n)])
            assert time.monotonic() - t0 < 5
            assert (info.value.count, info.value.limit, info.value.http_status) == (n, 32, 422)
            assert f"{n} given, at most 32" in str(info.value)
        assert len(fetch.seen) == 32
        assert db.live_batch_jobs("bob") == 0
    finally:
        r.close(timeout=WAIT)


def test_result_size_is_bounded_and_an_oversized_result_fails_only_its_target(
    db: dcache.DB,
) -> None:
    """A runaway fetch must not fill the database; the limit is exact and the job goes on."""
    limit = 1000

    def size(content: str) -> int:
        return len(json.dumps(Result(content).to_json(), ensure_ascii=False).encode("utf-8"))

    fits = "\u00e9" * 10
    fits += "a" * (limit - size(fits))
    assert size(fits) == limit
    contents = {"/fits": fits, "/over": fits + "a", "/small": "small"}

    def fetch(target: Target) -> Result:
        return Result(contents[target.url.removeprefix("https://e.example")])

    r = batch.Runner(db, fetch, batch.Config(max_result_bytes=limit))
    try:
        urls = [f"https://e.example{p}" for p in contents]
        job_id, _ = r.submit("alice", "user", [Target(u) for u in urls])
        job = finished(r, job_id)
        found = r.status(job_id)
    finally:
        r.close(timeout=WAIT)
    assert found is not None
    assert (job.status, job.targets_done) == ("partial", 3)
    fits_t, over_t, small_t = found[1]
    assert (fits_t.status, fits_t.result) == ("done", Result(fits))
    assert over_t.status == "failed" and over_t.result is None
    assert over_t.error == f"ResultTooLarge: result is {limit + 1} bytes, at most {limit} allowed"
    assert (small_t.status, small_t.result) == ("done", Result("small"))


@pytest.mark.slow
def test_a_result_of_megabytes_within_the_limit_is_stored_exactly(db: dcache.DB) -> None:
    """Fetched pages can be megabytes: below the limit they must survive every backend intact."""
    page = ("\u00e9\U0001f600<p>" + "x" * 1000 + "</p>\n") * 4000  # ~4 MiB of UTF-8
    r = batch.Runner(db, lambda _t: Result(page, {"n": len(page)}), batch.Config())
    try:
        job_id, _ = r.submit("alice", "user", [Target("https://e.example/big")])
        assert finished(r, job_id).status == "done"
        found = r.status(job_id)
    finally:
        r.close(timeout=WAIT)
    assert found is not None and found[1][0].result == Result(page, {"n": len(page)})


# -- hostile strings -------------------------------------------------------------------------


def test_hostile_ids_find_nothing_and_change_nothing(runner: batch.Runner) -> None:
    """Ids arrive straight from URLs: any string must answer 'unknown', never an error."""
    job_id, _ = runner.submit("alice", "user", [Target("https://e.example/keep")])
    finished(runner, job_id)
    for h in [*HOSTILE, job_id + "' OR '1'='1", job_id + "\x00", job_id + "%"]:
        assert runner.status(h) is None, hid(h)
        assert runner.job(h) is None, hid(h)
        assert runner.cancel(h) is False, hid(h)
        assert runner.wait(h, timeout=1) is None, hid(h)
    found = runner.status(job_id)
    assert found is not None and found[0].status == "done"


def test_hostile_callers_are_refused_or_stored_and_read_back_exactly(
    runner: batch.Runner,
) -> None:
    """A caller name is whatever the app authenticated: it must never reach SQL as code."""
    for i, h in enumerate(HOSTILE):
        target = [Target(f"https://e.example/caller/{i}")]
        if not storable(h, MAX_CALLER_LENGTH):
            with pytest.raises(InvalidTargetsError) as info:
                runner.submit(h, "user", target)
            assert info.value.field == "caller", hid(h)
            continue
        job_id, reused = runner.submit(h, h, target)
        assert not reused, hid(h)
        job = finished(runner, job_id)
        assert (job.caller, job.caller_class, job.status) == (h, h, "done"), hid(h)
        assert runner.submit(h, h, target) == (job_id, True), hid(h)  # idempotency holds
    assert runner.db.live_batch_jobs_total() == 0


def test_hostile_urls_are_refused_or_reach_fetch_and_read_back_exactly(
    db: dcache.DB,
) -> None:
    """A URL is passed to fetch and stored verbatim: no layer may rewrite or execute it."""
    fetch = EchoFetch()
    r = batch.Runner(db, fetch, batch.Config(jobs_per_caller=100, jobs_total=100))
    try:
        for i, h in enumerate(HOSTILE):
            if not valid_url(h):
                with pytest.raises(InvalidTargetsError) as info:
                    r.submit(f"u{i}", "user", [{"url": h}])
                assert info.value.field == "url", hid(h)
                continue
            job_id, _ = r.submit(f"u{i}", "user", [{"url": h}])
            assert finished(r, job_id).status == "done", hid(h)
            found = r.status(job_id)
            assert found is not None, hid(h)
            t = found[1][0]
            assert (t.url, t.result) == (h, Result(f"fetched {h}", {"url": h})), hid(h)
            assert fetch.seen[-1].url == h, hid(h)
    finally:
        r.close(timeout=WAIT)


def test_hostile_options_are_refused_or_read_back_exactly(runner: batch.Runner) -> None:
    """Options travel as JSON text in the store: quotes, NULs and surrogates must not escape."""
    for i, h in enumerate(HOSTILE):
        opts = {name: h for name in STR_OPTIONS}
        target = {"url": f"https://e.example/opt/{i}", "options": opts}
        if not storable(h, MAX_OPTION_LENGTH):
            if h == "":
                continue  # all-empty options are simply the defaults
            with pytest.raises(InvalidTargetsError) as info:
                runner.submit(f"o{i}", "user", [target])
            assert (info.value.field or "").startswith("options."), hid(h)
            continue
        job_id, _ = runner.submit(f"o{i}", "user", [target])
        finished(runner, job_id)
        found = runner.status(job_id)
        assert found is not None, hid(h)
        assert found[1][0].options == Options(**opts), hid(h)


def test_hostile_results_are_stored_exactly_or_fail_their_target_cleanly(
    db: dcache.DB,
) -> None:
    """A fetched page may hold anything: it is stored byte for byte, or refused, never a crash."""
    by_url = {f"https://e.example/res/{i}": h for i, h in enumerate(HOSTILE)}

    def fetch(target: Target) -> Result:
        h = by_url[target.url]
        return Result(h, {h: h, "list": [h]})

    r = batch.Runner(db, fetch, batch.Config())
    try:
        urls = list(by_url)
        jobs = []
        for start in range(0, len(urls), 32):
            job_id, _ = r.submit(f"r{start}", "user", [Target(u) for u in urls[start : start + 32]])
            jobs.append(job_id)
        for job_id in jobs:
            job = finished(r, job_id)
            assert job.targets_done == job.targets_total
            found = r.status(job_id)
            assert found is not None
            for t in found[1]:
                h = by_url[t.url]
                if storable(h, 10**9) or h == "" or "\x00" in h:
                    # Results are JSON text: NUL is escaped, an empty page is a page.
                    assert t.status == "done", (hid(h), t.error)
                    assert t.result == Result(h, {h: h, "list": [h]}), hid(h)
                else:
                    assert t.status == "failed" and "not storable" in t.error, hid(h)
    finally:
        r.close(timeout=WAIT)


def test_callers_differing_only_by_trailing_spaces_are_different_callers(db: dcache.DB) -> None:
    """'alice' and 'alice ' are two callers: their caps and their job lists must not mix.

    MySQL's ``utf8mb4_bin`` is a PAD SPACE collation ('alice' = 'alice '); the store must
    compare keys exactly on every backend.
    """
    release = threading.Event()

    def fetch(target: Target) -> Result:
        release.wait(WAIT)
        return Result("x")

    r = batch.Runner(db, fetch, batch.Config(jobs_per_caller=1))
    try:
        a, _ = r.submit("alice", "user", [Target("https://e.example/1")])
        b, reused = r.submit("alice ", "user", [Target("https://e.example/1")])
        assert not reused and a != b
        assert [j.id for j in r.jobs(caller="alice")] == [a]
        assert [j.id for j in r.jobs(caller="alice ")] == [b]
        assert db.live_batch_jobs("alice") == 1
    finally:
        release.set()
        r.close(timeout=WAIT)


def test_listing_the_jobs_of_a_hostile_caller_lists_nothing(runner: batch.Runner) -> None:
    """No job can belong to a caller submit would refuse: listing one must return []."""
    job_id, _ = runner.submit("alice", "user", [Target("https://e.example/l")])
    finished(runner, job_id)
    for h in HOSTILE:
        got = runner.jobs(caller=h)
        assert all(j.caller == h for j in got), hid(h)


def test_store_lookups_with_hostile_ids_answer_unknown(db: dcache.DB) -> None:
    """The store is public API too: an id no job can have is unknown, not an error."""
    for h in HOSTILE:
        assert db.get_job(h) is None, hid(h)
        assert db.get_job_with_targets(h) is None, hid(h)
        assert db.cancel(h) is False, hid(h)
        assert db.fail_job(h, "x") is False, hid(h)
        assert db.mark_finished(h) is False, hid(h)
        assert db.batch_job_by_idem(h, h) is None, hid(h)


def test_hostile_inputs_never_leak_a_store_error(runner: batch.Runner) -> None:
    """The summary rule: through the Runner, hostile text yields 422/None/False, never a 500."""
    for i, h in enumerate(HOSTILE):
        calls: list[Any] = [
            lambda h=h: runner.status(h),
            lambda h=h: runner.cancel(h),
            lambda h=h, i=i: runner.submit(h, "user", [{"url": f"https://e.example/s/{i}"}]),
            lambda h=h: runner.submit("alice", h, [{"url": "https://e.example/s"}]),
            lambda h=h, i=i: runner.submit(f"s{i}", "user", [{"url": h}]),
            lambda h=h, i=i: runner.submit(
                f"s{i}", "user", [{"url": "https://e.example/s", "options": {"grep": h}}]
            ),
        ]
        for call in calls:
            try:
                out = call()
            except InvalidTargetsError:
                continue
            except batch.StoreError as exc:
                pytest.fail(f"{hid(h)}: StoreError leaked: {exc}")
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str):
                finished(runner, out[0])
