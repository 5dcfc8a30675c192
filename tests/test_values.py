"""Value classes, target validation, the canonical form behind idem keys, Config, errors.

No database here: these are the pure rules every backend's tests build on.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from typing import Any

import attrs
import pytest

import batch
import dcache
from batch import (
    BusyError,
    CallerBusyError,
    Config,
    FetchError,
    InvalidTargetsError,
    Job,
    Options,
    Result,
    RunnerClosedError,
    SubmitError,
    Target,
    TargetStatus,
    TooManyTargetsError,
    canonical,
    idem_key,
    normalize_targets,
)
from batch._values import MAX_OPTION_LENGTH, MAX_URL_LENGTH

URL = "https://example.com/a"

# -- Options / Target / Result -------------------------------------------------------------


def test_options_default_to_empty_and_false() -> None:
    """Callers rely on the documented defaults: empty strings and False."""
    opts = Options()
    assert (opts.mode, opts.question, opts.pages, opts.grep, opts.jq) == ("", "", "", "", "")
    assert (opts.context, opts.recover) == (False, False)
    assert opts.to_json() == {}


def test_value_classes_are_frozen() -> None:
    """Targets are hashed into idem keys: mutating one after validation must be impossible."""
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Options().mode = "x"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Target(URL).url = "https://other/"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Result("x").content = "y"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Config().ttl = dt.timedelta(1)  # type: ignore[misc]


def test_target_to_json_leaves_out_empty_fields() -> None:
    """to_json is Go's omitempty: default options vanish, and so does an all-default block."""
    assert Target(URL).to_json() == {"url": URL}
    assert Target(URL, Options(mode="", context=False)).to_json() == {"url": URL}
    assert Target(URL, Options(mode="text", recover=True)).to_json() == {
        "url": URL,
        "options": {"mode": "text", "recover": True},
    }


@pytest.mark.parametrize(
    "target",
    [
        Target(URL),
        Target(URL, Options(mode="text")),
        Target(URL, Options(question="why?", pages="1-3", grep="a.*b", jq=".x")),
        Target(URL, Options(context=True, recover=True)),
        Target(
            "https://exämple.com/😀?q=1",
            Options("m", "q", "p", "g", "j", True, True),
        ),
    ],
    ids=["bare", "mode", "strings", "bools", "all-unicode"],
)
def test_target_json_round_trips(target: Target) -> None:
    """from_json(to_json(t)) == t, also through JSON text: what an HTTP layer relies on."""
    assert Target.from_json(target.to_json()) == target
    assert Target.from_json(json.loads(json.dumps(target.to_json()))) == target


def test_target_from_json_accepts_null_or_empty_options() -> None:
    """A JSON client that sends "options": null or {} means the defaults."""
    assert Target.from_json({"url": URL, "options": None}) == Target(URL)
    assert Target.from_json({"url": URL, "options": {}}) == Target(URL)


def test_result_meta_defaults_to_a_fresh_dict() -> None:
    """A shared mutable default would leak one target's meta into another's."""
    a, b = Result("a"), Result("b")
    assert a.meta == {} and b.meta == {}
    assert a.meta is not b.meta


def test_result_json_round_trips() -> None:
    """Stored results are rebuilt from JSON; meta left out when empty."""
    assert Result("x").to_json() == {"content": "x"}
    res = Result("ü😀", {"status": 200, "tags": ["a"], "nested": {"k": None}})
    assert Result.from_json(json.loads(json.dumps(res.to_json()))) == res


def test_job_terminal_and_to_json() -> None:
    """Job.terminal names the four final statuses; to_json gives ISO timestamps."""
    when = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
    for status, terminal in [
        ("queued", False),
        ("running", False),
        ("done", True),
        ("failed", True),
        ("partial", True),
        ("cancelled", True),
    ]:
        job = Job(
            id="j",
            status=status,
            error="",
            targets_total=1,
            targets_done=0,
            finished_at=when,
        )
        assert job.terminal is terminal
    out = job.to_json()
    assert out["finished_at"] == when.isoformat()
    json.dumps(out)  # JSON-ready


def test_target_status_to_json_is_json_ready() -> None:
    """An HTTP layer serialises TargetStatus directly."""
    ts = TargetStatus(
        idx=0,
        url=URL,
        status="done",
        result=Result("x", {"a": 1}),
        error="",
        hint="",
        options=Options(mode="m"),
    )
    out = json.loads(json.dumps(ts.to_json()))
    assert out["result"] == {"content": "x", "meta": {"a": 1}}
    assert out["options"] == {"mode": "m"}


# -- canonical form and idem_key ------------------------------------------------------------


def test_key_ignores_field_order() -> None:
    """Two clients ordering JSON fields differently submit the same job."""
    a = [{"url": URL, "options": {"mode": "m", "context": True}}]
    b = [{"options": {"context": True, "mode": "m"}, "url": URL}]
    assert canonical(normalize_targets(a)) == canonical(normalize_targets(b))
    assert idem_key("c", normalize_targets(a)) == idem_key("c", normalize_targets(b))


def test_key_ignores_json_whitespace() -> None:
    """The same JSON body pretty-printed or compact is the same job."""
    compact = '[{"url":"https://example.com/a","options":{"grep":"x"}}]'
    pretty = (
        '[\n  {\n    "url" : "https://example.com/a",\n    "options" : { "grep" : "x" }\n  }\n]'
    )
    assert idem_key("c", normalize_targets(json.loads(compact))) == idem_key(
        "c", normalize_targets(json.loads(pretty))
    )


def test_default_valued_options_never_change_the_key() -> None:
    """Spelling out a default (or not) must not create a second job."""
    all_defaults = {
        "mode": "",
        "question": "",
        "pages": "",
        "grep": "",
        "jq": "",
        "context": False,
        "recover": False,
    }
    spellings: list[list[Any]] = [
        [Target(URL)],
        [Target(URL, Options())],
        [{"url": URL}],
        [{"url": URL, "options": {}}],
        [{"url": URL, "options": None}],
        [{"url": URL, "options": all_defaults}],
        [{"url": URL, "options": {"context": False}}],
        [{"url": URL, "options": {"mode": ""}}],
    ]
    keys = {idem_key("c", normalize_targets(s)) for s in spellings}
    assert len(keys) == 1
    assert canonical(normalize_targets(spellings[-1])) == json.dumps(
        [{"url": URL}], separators=(",", ":")
    )


def test_any_real_difference_changes_the_key() -> None:
    """A different URL, option, order or caller is a different job, never a reuse."""
    base = [Target(URL), Target("https://example.com/b")]
    variants: list[tuple[str, list[Target]]] = [
        ("c", base),
        ("d", base),  # another caller
        ("C", base),  # callers are case-sensitive
        ("c", base[::-1]),  # order
        ("c", base[:1]),  # fewer targets
        ("c", [Target(URL + "/"), base[1]]),
        ("c", [Target("https://example.com/A"), base[1]]),
    ]
    for field, value in [
        ("mode", "m"),
        ("question", "q"),
        ("pages", "1"),
        ("grep", "g"),
        ("jq", "."),
        ("context", True),
        ("recover", True),
    ]:
        variants.append(("c", [Target(URL, Options(**{field: value})), base[1]]))
    keys = [idem_key(caller, targets) for caller, targets in variants]
    assert len(set(keys)) == len(variants)


def test_known_vector_pins_the_persisted_key_format() -> None:
    """Keys are persisted: an upgrade that changes the canonical form would break reuse."""
    targets = [
        Target("https://example.com/ä?q=1", Options(mode="text", context=True, grep="naïve")),
        Target("https://b.example/"),
    ]
    expected_canonical = (
        '[{"options":{"context":true,"grep":"naïve","mode":"text"},'
        '"url":"https://example.com/ä?q=1"},{"url":"https://b.example/"}]'
    )
    assert canonical(targets) == expected_canonical
    # The documented formula, by hand.
    body = json.dumps(
        [
            {
                "url": "https://example.com/ä?q=1",
                "options": {"mode": "text", "context": True, "grep": "naïve"},
            },
            {"url": "https://b.example/"},
        ],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    by_hand = hashlib.sha256(("alice" + "\x00" + body).encode("utf-8")).hexdigest()
    assert idem_key("alice", targets) == by_hand
    assert by_hand == "80664cf9749e092d9bf3a00adaca50797e39cb0282514810f088c98b930e73d8"


# -- validation -----------------------------------------------------------------------------


def _invalid(targets: object) -> InvalidTargetsError:
    with pytest.raises(InvalidTargetsError) as info:
        normalize_targets(targets)
    return info.value


@pytest.mark.parametrize(
    "targets",
    ["https://example.com/a", b"https://x", {"url": URL}, None, 42],
    ids=["str", "bytes", "mapping", "none", "int"],
)
def test_a_non_list_is_invalid(targets: object) -> None:
    """A single URL or object instead of a list is a client bug worth a clear 422."""
    err = _invalid(targets)
    assert "list" in str(err)
    assert err.index is None


def test_an_empty_list_is_invalid() -> None:
    """An empty job would never finish meaningfully; refuse it."""
    err = _invalid([])
    assert "empty" in str(err)
    assert err.index is None


BAD_TARGETS: list[tuple[str, object, str]] = [
    # (id, the bad item placed at index 2, the field the error must name)
    ("int-item", 42, ""),
    ("str-item", "https://example.com/x", ""),
    ("list-item", [URL], ""),
    ("none-item", None, ""),
    ("no-url", {"options": {}}, "url"),
    ("empty-url", {"url": ""}, "url"),
    ("int-url", {"url": 5}, "url"),
    ("none-url", {"url": None}, "url"),
    ("padded-url", {"url": " https://example.com/x"}, "url"),
    ("nul-url", {"url": "https://example.com/\x00"}, "url"),
    ("surrogate-url", {"url": "https://example.com/\ud800"}, "url"),
    ("long-url", {"url": "https://e.com/" + "x" * MAX_URL_LENGTH}, "url"),
    ("unknown-field", {"url": URL + "x", "headers": {}}, "headers"),
    ("unknown-option", {"url": URL + "x", "options": {"timeout": 3}}, "options.timeout"),
    ("options-not-object", {"url": URL + "x", "options": "fast"}, "options"),
    ("options-list", {"url": URL + "x", "options": []}, "options"),
    ("context-str", {"url": URL + "x", "options": {"context": "yes"}}, "options.context"),
    ("recover-int", {"url": URL + "x", "options": {"recover": 1}}, "options.recover"),
    ("mode-int", {"url": URL + "x", "options": {"mode": 1}}, "options.mode"),
    ("jq-none", {"url": URL + "x", "options": {"jq": None}}, "options.jq"),
    ("grep-nul", {"url": URL + "x", "options": {"grep": "a\x00"}}, "options.grep"),
    (
        "question-surrogate",
        {"url": URL + "x", "options": {"question": "\udfff"}},
        "options.question",
    ),
    (
        "long-option",
        {"url": URL + "x", "options": {"pages": "1" * (MAX_OPTION_LENGTH + 1)}},
        "options.pages",
    ),
    ("target-int-url", Target(5), "url"),  # type: ignore[arg-type]
    ("target-bad-option", Target(URL + "x", Options(mode=1)), "options.mode"),  # type: ignore[arg-type]
    ("target-dict-options", Target(URL + "x", {"mode": "m"}), "options"),  # type: ignore[arg-type]
    ("target-context-str", Target(URL + "x", Options(context="yes")), "options.context"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(
    ("item", "field"), [c[1:] for c in BAD_TARGETS], ids=[c[0] for c in BAD_TARGETS]
)
def test_a_malformed_target_is_named_by_index_and_field(item: object, field: str) -> None:
    """The error tells the client exactly which target and which field to fix."""
    err = _invalid([{"url": "https://ok/0"}, Target("https://ok/1"), item])
    assert isinstance(err, ValueError)
    assert isinstance(err, SubmitError)
    assert err.http_status == 422
    assert err.index == 2
    assert str(err).startswith("targets[2]")
    if field:
        assert err.field == field
        assert field.rsplit(".", maxsplit=1)[-1] in str(err)


@pytest.mark.parametrize(
    "pair",
    [
        [{"url": URL}, {"url": URL}],
        [Target(URL), {"url": URL}],
        [Target(URL, Options(mode="m")), {"options": {"mode": "m"}, "url": URL}],
        [{"url": URL, "options": {"context": False}}, Target(URL)],
    ],
    ids=["dicts", "target-and-dict", "same-options", "default-options"],
)
def test_duplicate_targets_are_named(pair: list[Any]) -> None:
    """Fetching the same target twice in one job is always a client mistake."""
    err = _invalid([{"url": "https://other/"}, *pair])
    assert err.index == 2
    assert "targets[2]" in str(err) and "targets[1]" in str(err)


def test_same_url_with_different_options_is_not_a_duplicate() -> None:
    """Options are part of a target's identity (grep for two terms on one page)."""
    out = normalize_targets([{"url": URL}, {"url": URL, "options": {"grep": "x"}}])
    assert len(out) == 2


def test_limits_are_inclusive() -> None:
    """A URL or option exactly at its documented limit is valid."""
    url = "https://e.com/" + "x" * (MAX_URL_LENGTH - len("https://e.com/"))
    [t] = normalize_targets([{"url": url, "options": {"grep": "g" * MAX_OPTION_LENGTH}}])
    assert len(t.url) == MAX_URL_LENGTH


def test_targets_may_mix_objects_and_dicts_and_any_iterable() -> None:
    """A tuple or generator of Targets and dicts is accepted; order is kept."""
    items = (x for x in [Target("https://a/"), {"url": "https://b/"}])
    assert [t.url for t in normalize_targets(items)] == ["https://a/", "https://b/"]


# -- Config ---------------------------------------------------------------------------------


def test_config_defaults() -> None:
    """The documented defaults: a day's lease, 32 targets, 1 job per caller, 8 in all."""
    cfg = Config()
    assert cfg.ttl == dt.timedelta(hours=24)
    assert (cfg.targets_per_job, cfg.jobs_per_caller, cfg.jobs_total) == (32, 1, 8)
    assert cfg.max_result_bytes == 8 * 1024 * 1024


@pytest.mark.parametrize(
    "field", ["ttl", "targets_per_job", "jobs_per_caller", "jobs_total", "max_result_bytes"]
)
def test_config_zero_means_default(field: str) -> None:
    """Go-style zero values: an unset (0) setting from a config file means the default."""
    assert getattr(Config(**{field: 0}), field) == getattr(Config(), field)


def test_config_zero_timedelta_means_default() -> None:
    """timedelta(0) is the zero value of a duration."""
    assert Config(ttl=dt.timedelta(0)).ttl == Config().ttl


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ttl", -1),
        ("ttl", dt.timedelta(seconds=-1)),
        ("targets_per_job", -1),
        ("jobs_per_caller", -5),
        ("jobs_total", -1),
        ("max_result_bytes", -1),
    ],
)
def test_config_negative_is_a_value_error(field: str, value: object) -> None:
    """A negative limit is a configuration mistake; fail at start, not at the first submit."""
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})


@pytest.mark.parametrize(
    ("value", "expected"),
    [(3600, dt.timedelta(hours=1)), (1.5, dt.timedelta(seconds=1.5))],
)
def test_config_ttl_accepts_seconds(value: float, expected: dt.timedelta) -> None:
    """A ttl read from an environment variable is a number of seconds."""
    assert Config(ttl=value).ttl == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [("ttl", True), ("ttl", "3600"), ("targets_per_job", 1.5), ("jobs_total", "8")],
)
def test_config_wrong_types_are_refused(field: str, value: object) -> None:
    """A string or bool where a number belongs must not silently become a limit."""
    with pytest.raises((TypeError, ValueError)):
        Config(**{field: value})


# -- errors ---------------------------------------------------------------------------------


def test_error_classes_carry_context_and_http_status() -> None:
    """An HTTP layer maps errors to responses from their attributes alone."""
    e1 = TooManyTargetsError(40, 32)
    assert (e1.count, e1.limit, e1.http_status) == (40, 32, 422)
    assert "40" in str(e1) and "32" in str(e1)
    e2 = CallerBusyError("alice", 1, 1)
    assert (e2.caller, e2.live, e2.limit, e2.http_status) == ("alice", 1, 1, 429)
    assert "alice" in str(e2)
    e3 = BusyError(8, 8)
    assert (e3.live, e3.limit, e3.http_status) == (8, 8, 429)
    e4 = InvalidTargetsError("bad", index=3, field="url")
    assert (e4.index, e4.field, e4.http_status) == (3, "url", 422)
    for err in (e1, e2, e3, e4, RunnerClosedError("closed")):
        assert isinstance(err, SubmitError)
    assert isinstance(e4, ValueError)
    assert isinstance(RunnerClosedError("closed"), RuntimeError)


def test_fetch_error_keeps_message_and_hint() -> None:
    """A fetch explains a failure with a message and an optional hint for the user."""
    err = FetchError("404 not found", hint="check the URL")
    assert (err.message, err.hint, str(err)) == ("404 not found", "check the URL", "404 not found")
    assert FetchError("x").hint == ""


def test_public_names_are_exported() -> None:
    """Hidden acceptance tests import these names from the package."""
    for name in [
        "BusyError",
        "CallerBusyError",
        "Config",
        "FetchError",
        "InvalidTargetsError",
        "Job",
        "Options",
        "Result",
        "Runner",
        "SubmitError",
        "Target",
        "TargetStatus",
        "TooManyTargetsError",
    ]:
        assert hasattr(batch, name), name


# Keys computed by release 0.1.0 (commit f60951a) for these submissions. Keys are
# persisted: a change to the canonical form would silently stop matching stored jobs.
_RELEASED_KEYS = [
    (
        "alice",
        [{"url": "https://example.org/a"}],
        "1143582698ebdc288d9baae13496c9f8f95b329583fa14c7fe2e3884fa367e71",
    ),
    (
        "alice",
        [
            {"url": "https://example.org/a"},
            {"url": "https://example.org/b", "options": {"grep": "price", "mode": "pdf"}},
        ],
        "cfa7f0ec2e188722ae77945b89abd59b18a87fe813893301586e5087bd3eda8d",
    ),
    (
        "Zoë 東京",
        [
            {
                "url": "https://例え.jp/パス?q=ü",
                "options": {"question": "¿qué?", "context": True, "recover": False, "pages": ""},
            }
        ],
        "3ef1732853033234c9195316d32838fd5bc45effae38d884703f527984386174",
    ),
    (
        "bob",
        [
            {"url": "http://x/1", "options": {"jq": ".a | .b", "pages": "1-3", "recover": True}},
            {"url": "http://x/2", "options": {}},
        ],
        "a96c4bb4b4b145441a0713649dc7254199dfea6672f42fbe63b1cc93747bc405",
    ),
]


@pytest.mark.parametrize(("caller", "targets", "key"), _RELEASED_KEYS)
def test_idempotency_keys_match_the_ones_the_previous_release_persisted(
    caller: str, targets: list[dict[str, object]], key: str
) -> None:
    """A job stored by 0.1.0 must still be found by the same submission after an upgrade."""
    assert batch.idem_key(caller, batch.normalize_targets(targets)) == key


def test_client_keys_match_the_ones_the_previous_release_persisted() -> None:
    """Idempotency-Key values map to the same stored key as in 0.1.0."""
    expected = "cf65efd9a6bfb1862a8a597db9351800b1ba572818a1be057cc4fa89c98926d9"
    assert batch.client_idem_key("alice", "key-1") == expected


def test_options_are_stored_in_the_canonical_form_and_read_back_from_either_form(
    db: dcache.DB,
) -> None:
    """One encoding for options (the canonical one); rows written by 0.1.0 still read."""
    fetched: list[batch.Target] = []

    def fetch(t: batch.Target) -> batch.Result:
        fetched.append(t)
        return batch.Result("x")

    opts = {"mode": "pdf", "grep": "price", "context": True}
    with batch.Runner(db, fetch) as runner:
        job_id, _ = runner.submit("alice", "free", [{"url": "https://e.com/a", "options": opts}])
        assert runner.wait(job_id, timeout=10) is not None
        found = db.get_job_with_targets(job_id)
        assert found is not None
        assert found[1][0].options == '{"context":true,"grep":"price","mode":"pdf"}'
        status = runner.status(job_id)
        assert status is not None
        assert status[1][0].options == batch.Options(mode="pdf", grep="price", context=True)
    assert fetched == [batch.Target("https://e.com/a", batch.Options(**opts))]  # type: ignore[arg-type]


def test_checked_targets_are_not_checked_again_and_cannot_grow() -> None:
    """``Checked(items)`` checks items as normalize_targets does and seals what it returned:
    handed to normalize_targets, they come back as they are (the HTTP view and the CLI check
    targets once and submit them so); a tuple takes no additions."""
    from batch._values import Checked

    raw = [{"url": "https://example.org/a"}, {"url": "https://example.org/b"}]
    sealed = Checked(raw)
    assert list(sealed) == batch.normalize_targets(raw)
    again = batch.normalize_targets(sealed)
    assert again == list(sealed) and all(a is b for a, b in zip(again, sealed, strict=True))
    assert not hasattr(sealed, "append")
    # Nothing unchecked can be sealed: making one checks it, as normalize_targets does.
    bad = batch.Target("")
    for items in ([bad], [], "https://example.org/", [raw[0], raw[0]]):
        with pytest.raises(batch.InvalidTargetsError) as made:
            Checked(items)
        with pytest.raises(batch.InvalidTargetsError) as normalized:
            batch.normalize_targets(items)
        assert str(made.value) == str(normalized.value)
    # Only the sealed type is trusted: the same targets in a plain list or tuple are checked.
    with pytest.raises(batch.InvalidTargetsError, match=r"targets\[0\]"):
        batch.normalize_targets((bad,))
    with pytest.raises(batch.InvalidTargetsError, match=r"targets\[0\]"):
        batch.normalize_targets([bad])
    # An empty sealed tuple (made around the check) is still refused.
    empty = tuple.__new__(Checked, ())
    with pytest.raises(batch.InvalidTargetsError, match="must not be empty"):
        batch.normalize_targets(empty)
