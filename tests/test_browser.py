"""The dashboard in a real browser: Debian's chromium driven by Playwright, on a real server.

Chromium comes from apt (``chromium``), never from a download at test time. Without it (or
without Playwright) these tests skip visibly, and fail when ``CI`` is set.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _fetchers import WAIT, FakeFetch, wait_for
from _ops import HOSTILE, OPERATOR_COOKIE, make_app, serving

import batch
import dcache

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("BATCH_TEST_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CONFIG = batch.Config(heartbeat=dt.timedelta(seconds=30), jobs_per_caller=1, jobs_total=8)
MS = int(WAIT * 1000)
DOCS_SHOTS = os.environ.get("BATCH_DOCS_SCREENSHOTS")  # a folder: also save the README's


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install playwright)"
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        return f"{CHROMIUM} is missing (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def playwright() -> Iterator[Any]:
    why = _missing()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


class Browser:
    """One fresh chromium profile; console errors and page errors are collected."""

    def __init__(self, playwright: Any, profile: Path, base: str, operator: bool) -> None:
        self.errors: list[str] = []
        self.context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=ARGS
        )
        self.context.set_default_timeout(MS)
        if operator:
            self.context.add_cookies([{"name": OPERATOR_COOKIE, "value": "yes", "url": base}])
        self.page = self.context.pages[0] if self.context.pages else self.context.new_page()
        self.page.set_viewport_size({"width": 1280, "height": 800})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def close(self) -> None:
        self.context.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dcache.DB]:
    from conftest import open_backend

    db = open_backend(request.param, tmp_path)
    try:
        yield db
    finally:
        db.close()


@pytest.fixture
def fake() -> Iterator[FakeFetch]:
    f = FakeFetch()
    yield f
    f.release_all()


@pytest.fixture
def site(store: dcache.DB, fake: FakeFetch) -> Iterator[tuple[batch.Runner, str]]:
    runner = batch.Runner(store, fake, CONFIG)
    try:
        with serving(make_app(runner)) as base:
            yield runner, base
    finally:
        fake.release_all()
        runner.close(timeout=WAIT)


@pytest.fixture
def browser(playwright: Any, site: tuple[batch.Runner, str], tmp_path: Path) -> Iterator[Browser]:
    b = Browser(playwright, tmp_path / "profile", site[1], operator=True)
    try:
        yield b
    finally:
        b.close()
    assert b.errors == [], f"browser console errors: {b.errors}"


def shot(page: Any, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / name), full_page=True)
    if DOCS_SHOTS:
        page.screenshot(path=str(Path(DOCS_SHOTS) / name), full_page=True)


def test_a_submitted_job_appears_in_the_list(
    site: tuple[batch.Runner, str], browser: Browser, fake: FakeFetch, tmp_path: Path
) -> None:
    """The list shows new jobs first, the counts, the live load and who is at the cap."""
    runner, base = site
    fake.behave("https://example.com/missing", _fail)
    fake.block("https://example.com/slow-report")
    jobs = [
        runner.submit(
            "reports@acme", "paid", [{"url": f"https://example.com/page/{i}"} for i in range(4)]
        ),
        runner.submit(
            "ana",
            "free",
            [{"url": "https://example.com/missing"}, {"url": "https://example.com/ok"}],
        ),
        runner.submit("ops-bot", "internal", [{"url": "https://example.com/missing"}]),
    ]
    for job_id, _ in jobs:
        assert runner.wait(job_id, timeout=WAIT) is not None
    live, _ = runner.submit(
        "nightly",
        "paid",
        [{"url": "https://example.com/slow-report"}, {"url": "https://example.com/b"}],
    )
    fake.wait_entered("https://example.com/slow-report")
    page = browser.page
    page.goto(base + "/batch/")
    rows = page.locator("tr.job-row")
    assert rows.count() == 4
    assert rows.first.get_attribute("data-job-id") == live
    assert rows.first.locator(".badge").inner_text() == "running"
    assert page.locator("#live-count").inner_text().startswith("1 of 8")
    assert "nightly" in page.locator(".at-cap").inner_text()
    assert page.locator('[data-status-count="partial"]').inner_text() == "1"
    shot(page, tmp_path, "dashboard-jobs.png")
    page.locator("a.chip-failed").click()
    page.wait_for_url("**status=failed")
    assert page.locator("tr.job-row").count() == 1
    assert "ops-bot" in page.locator("tr.job-row").inner_text()
    fake.release("https://example.com/slow-report")
    assert runner.wait(live, timeout=WAIT) is not None


def _fail(target: batch.Target) -> batch.Result:
    raise batch.FetchError("HTTP 404 Not Found", hint="check the URL, or drop the target")


def test_job_page_shows_targets_turning_done_without_a_reload(
    site: tuple[batch.Runner, str], browser: Browser, fake: FakeFetch, tmp_path: Path
) -> None:
    """Progress follows the drain as a gated fetch releases targets one by one, no reload."""
    runner, base = site
    urls = [f"https://example.com/articles/{i}" for i in range(4)]
    fake.block(*urls)
    fake.behave(urls[2], _fail)
    job_id, _ = runner.submit("newsroom", "paid", [{"url": u} for u in urls])
    page = browser.page
    page.goto(f"{base}/batch/jobs/{job_id}")
    page.evaluate("window.__sameDocument = true")  # gone if the page ever reloads
    fake.wait_entered(urls[0])
    page.wait_for_selector('tr.target[data-idx="0"].in-flight[data-status="running"]')
    for i, url in enumerate(urls):
        fake.wait_entered(url)
        page.wait_for_selector(f'tr.target[data-idx="{i}"].in-flight')
        if i == 3:  # the failed target's error and hint are on the page by now
            shot(page, tmp_path, "dashboard-job.png")
        fake.release(url)
        expected = "failed" if i == 2 else "done"
        page.wait_for_selector(f'tr.target[data-idx="{i}"][data-status="{expected}"]')
        later = page.locator(f'tr.target[data-idx="{i + 1}"]')
        if i + 1 < len(urls):
            assert later.get_attribute("data-status") in ("pending", "running")
    page.wait_for_selector('body[data-finished="1"]')
    assert page.locator("#job-status").inner_text() == "partial"
    assert page.locator("#job-progress").get_attribute("value") == "4"
    assert "HTTP 404 Not Found" in page.locator('tr.target[data-idx="2"] .t-error').inner_text()
    assert page.locator("#cancel-form").is_hidden()
    assert page.evaluate("window.__sameDocument") is True


def test_cancel_stops_a_live_job_and_the_page_says_so(
    site: tuple[batch.Runner, str], browser: Browser, fake: FakeFetch
) -> None:
    """The Cancel button (a POST with its token) stops the job after its in-flight target."""
    runner, base = site
    fake.block("https://example.com/a")
    job_id, _ = runner.submit(
        "ana", "free", [{"url": "https://example.com/a"}, {"url": "https://example.com/b"}]
    )
    fake.wait_entered("https://example.com/a")
    page = browser.page
    page.goto(f"{base}/batch/jobs/{job_id}")
    page.locator("#cancel-form button").click()
    page.wait_for_selector("#cancel-outcome")
    assert "Cancelled" in page.locator("#cancel-outcome").inner_text()
    assert page.locator("#job-status").inner_text() == "cancelled"
    fake.release("https://example.com/a")
    page.wait_for_selector('body[data-finished="1"]')
    assert page.locator('tr.target[data-idx="0"]').get_attribute("data-status") == "done"
    assert page.locator('tr.target[data-idx="1"]').get_attribute("data-status") == "pending"
    job = runner.wait(job_id, timeout=WAIT)
    assert job is not None and job.status == "cancelled"
    assert fake.count("https://example.com/b") == 0


def test_a_hostile_result_renders_as_text(
    site: tuple[batch.Runner, str], browser: Browser, fake: FakeFetch
) -> None:
    """Script in a result, an error, a hint or a URL runs nowhere; it reads as what it is."""
    runner, base = site
    url = "https://example.com/" + HOSTILE
    fake.behave(url, lambda t: batch.Result(HOSTILE + "\nrest of the page"))
    fake.behave("https://example.com/x" + HOSTILE, lambda t: _raise_hostile())
    job_id, _ = runner.submit(
        HOSTILE, "free", [{"url": url}, {"url": "https://example.com/x" + HOSTILE}]
    )
    assert runner.wait(job_id, timeout=WAIT) is not None
    page = browser.page
    page.goto(f"{base}/batch/jobs/{job_id}")
    page.locator('a.preview-link[data-idx="0"]').click()
    page.wait_for_selector("#preview-0:not([hidden])")
    assert page.locator("#preview-0 pre").inner_text().startswith(HOSTILE)
    assert HOSTILE in page.locator('tr.target[data-idx="0"] td.url').inner_text()
    assert page.locator('tr.target[data-idx="1"] .t-error').inner_text() == HOSTILE
    assert page.locator('tr.target[data-idx="1"] .t-hint').inner_text() == HOSTILE
    page.goto(f"{base}/batch/")
    assert HOSTILE in page.locator("tr.job-row td.caller").inner_text()
    page.goto(f"{base}/batch/jobs/{job_id}?show=0")  # the no-script preview too
    assert page.locator("#preview-0 pre").inner_text().startswith(HOSTILE)
    assert page.locator("main img").count() == 0
    assert page.evaluate("typeof window.__pwned") == "undefined"


@pytest.mark.parametrize(
    ("ctype", "page"),
    [
        ("text/html", f"<html><body>{HOSTILE}<p id=seen>fetched</p></body></html>"),
        (
            "image/svg+xml",
            '<svg xmlns="http://www.w3.org/2000/svg" onload="window.__pwned = 1">'
            "<script>window.__pwned = 1</script><text y='20'>fetched</text></svg>",
        ),
    ],
    ids=["html", "svg"],
)
def test_fetched_content_opens_as_an_inert_page(
    site: tuple[batch.Runner, str], browser: Browser, fake: FakeFetch, ctype: str, page: str
) -> None:
    """A fetched page is a stranger's: opened through ``/content`` on the app's own origin
    its script must not run (it would act with the user's cookies on the API and the
    dashboard). The answer is sandboxed: shown, inert, in an origin of its own."""
    runner, base = site
    url = "https://example.com/page"
    fake.behave(url, lambda t: batch.Result(page, {"content_type": ctype}))
    job_id, _ = runner.submit("api-user", "api", [{"url": url}])
    assert runner.wait(job_id, timeout=WAIT) is not None
    tab = browser.page
    resp = tab.goto(f"{base}/jobs/{job_id}/targets/0/content")
    assert resp is not None and resp.status == 200
    assert "sandbox" in resp.headers["content-security-policy"]
    assert "fetched" in tab.content()
    assert tab.evaluate("typeof window.__pwned") == "undefined"
    assert tab.evaluate("window.origin") == "null"  # an opaque origin: no cookies, no API
    # What the browser says of the page's blocked script and image (and of the favicon
    # it looks for) is expected here: the page is a stranger's, not the dashboard.
    browser.errors.clear()


def _raise_hostile() -> batch.Result:
    raise batch.FetchError(HOSTILE, hint=HOSTILE)


def test_forbidden_without_authorization(
    playwright: Any, site: tuple[batch.Runner, str], tmp_path: Path
) -> None:
    """A browser that authorize() refuses sees a 403 and no job data."""
    runner, base = site
    job_id, _ = runner.submit("ana", "free", [{"url": "https://example.com/a"}])
    assert runner.wait(job_id, timeout=WAIT) is not None
    b = Browser(playwright, tmp_path / "stranger", base, operator=False)
    try:
        for path in ("/batch/", f"/batch/jobs/{job_id}"):
            resp = b.page.goto(base + path)
            assert resp is not None and resp.status == 403
            assert "Not authorized" in b.page.locator("main").inner_text()
            assert "ana" not in b.page.content()
        # The 403 page's own script and styles load: the only console error is chromium's
        # report of the document's own 403.
        assert b.errors and all("status of 403" in e for e in b.errors), b.errors
        assert len(b.errors) == 2
    finally:
        b.close()


_COUNT_POLLS = """
window.__polls = 0;
(function () {
  var original = window.fetch;
  window.fetch = function (url) {
    if (String(url).indexOf("progress.json") !== -1) { window.__polls += 1; }
    return original.apply(this, arguments);
  };
})();
"""


def _polls(page: Any) -> int:
    return int(page.evaluate("window.__polls"))


@pytest.mark.parametrize(
    ("why", "status", "says"),
    [("purged", 404, "job is gone"), ("denied", 403, "access denied")],
)
def test_live_view_stops_when_the_job_is_gone_or_access_ends(
    site: tuple[batch.Runner, str],
    browser: Browser,
    fake: FakeFetch,
    why: str,
    status: int,
    says: str,
) -> None:
    """A purged job (404) or an operator no longer let in (403) ends the polling: the page
    says why instead of retrying every 5 s forever."""
    runner, base = site
    fake.block("https://example.com/a")
    job_id, _ = runner.submit("ana", "free", [{"url": "https://example.com/a"}])
    fake.wait_entered("https://example.com/a")
    page = browser.page
    page.add_init_script(_COUNT_POLLS)
    # The page's timers run on a paused clock the test moves: every poll is the test's own.
    page.clock.install(time=dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc))
    page.clock.pause_at(dt.datetime(2030, 1, 1, 0, 0, 1, tzinfo=dt.timezone.utc))
    with page.expect_response(lambda r: "progress.json" in r.url) as first:
        page.goto(f"{base}/batch/jobs/{job_id}")
    assert first.value.status == 200  # the job is live: the page keeps following it
    if why == "purged":
        fake.release("https://example.com/a")
        assert runner.wait(job_id, timeout=WAIT) is not None
        later = dcache.utcnow() + CONFIG.ttl + dt.timedelta(days=1)
        assert runner.db.purge_expired(now=later) == 1
    else:
        browser.context.clear_cookies()  # the operator's session ended
    before = _polls(page)

    def polled_again() -> bool:
        page.clock.run_for(1000)  # the next poll is due a second later
        return _polls(page) > before

    wait_for(polled_again, "the page's next poll")
    indicator = page.locator("#live-indicator")
    wait_for(lambda: says in indicator.inner_text(), f"the page to say {says!r}")
    stopped = _polls(page)
    page.clock.run_for(10 * 60 * 1000)  # ten minutes: no retry, no backoff
    assert _polls(page) == stopped
    assert says in indicator.inner_text()
    # chromium reports the refused poll itself on the console; nothing else went wrong.
    assert browser.errors and all(f"status of {status}" in e for e in browser.errors)
    browser.errors.clear()
