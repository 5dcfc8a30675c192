/* batch dashboard: live progress on a job's page and result previews in place.
 *
 * Served by the blueprint (no build step, no CDN) and loaded with `defer`, so it works
 * under `Content-Security-Policy: default-src 'self'`. Stored text only ever goes into
 * the page through textContent, never as HTML. Without this script the pages work the
 * same, one reload at a time.
 */
(function () {
  "use strict";

  var POLL_MS = 1000;
  var BACKOFF_MS = 5000;

  function size(n) {
    if (n === null || n === undefined) { return ""; }
    if (n < 1024) { return n + " B"; }
    if (n < 1024 * 1024) { return (n / 1024).toFixed(1) + " KiB"; }
    return (n / (1024 * 1024)).toFixed(1) + " MiB";
  }

  function setBadge(el, status) {
    el.textContent = status;
    el.className = el.className.replace(/\bbadge-\S+/g, "").trim() + " badge-" + status;
  }

  function text(id, value) {
    var el = document.getElementById(id);
    if (el) { el.textContent = value; }
  }

  function applyProgress(data) {
    var job = data.job;
    var badge = document.getElementById("job-status");
    if (badge) { setBadge(badge, job.status); }
    var bar = document.getElementById("job-progress");
    if (bar) { bar.max = job.targets_total; bar.value = job.stored; }
    text("job-counts", job.stored + "/" + job.targets_total + " stored, " +
      job.targets_failed + " failed");
    text("job-finished", job.finished_at);
    text("job-duration", job.duration);
    text("job-error", job.error);
    var form = document.getElementById("cancel-form");
    if (form) { form.hidden = !job.live; }
    data.targets.forEach(function (t) {
      var row = document.querySelector('tr.target[data-idx="' + t.idx + '"]');
      if (!row) { return; }
      row.setAttribute("data-status", t.status);
      row.classList.toggle("in-flight", t.in_flight);
      var badge = row.querySelector(".t-status");
      if (badge) { setBadge(badge, t.status); }
      row.querySelector(".t-error").textContent = t.error;
      row.querySelector(".t-hint").textContent = t.hint;
      row.querySelector(".t-size").textContent = t.size;
      var link = row.querySelector(".preview-link");
      if (link) { link.hidden = t.result_bytes === null; }
    });
  }

  // Answers that no retry can change: the job is gone (purged, or its lease lapsed), or
  // this browser may no longer look (authorize refused it, or sent it to a login page).
  // Polling stops and the page says why; a reload shows the server's own answer.
  var GONE = "the job is gone (purged, or its lease lapsed); live updates stopped";
  var DENIED = "access denied; live updates stopped";

  function stopReason(resp) {
    if (resp.status === 404) { return GONE; }
    if (resp.status === 401 || resp.status === 403 || resp.redirected) { return DENIED; }
    return null;
  }

  function follow(url) {
    var etag = null;
    var indicator = document.getElementById("live-indicator");
    function say(message) { if (indicator) { indicator.textContent = message; } }
    function next(ms) { window.setTimeout(poll, ms); }
    function poll() {
      var headers = { "Accept": "application/json" };
      if (etag) { headers["If-None-Match"] = etag; }
      var stopped = null;
      fetch(url, { headers: headers, cache: "no-store", credentials: "same-origin" })
        .then(function (resp) {
          if (resp.status === 304) { return null; }
          stopped = stopReason(resp);
          if (stopped) { return null; }
          if (!resp.ok) { throw new Error("HTTP " + resp.status); }
          etag = resp.headers.get("ETag");
          return resp.json();
        })
        .then(function (data) {
          if (stopped) { say(stopped); return; }
          if (data) { applyProgress(data); }
          if (data && data.job.finished) {
            document.body.setAttribute("data-finished", "1");
            say("finished");
            return;
          }
          say("live");
          next(POLL_MS);
        })
        .catch(function () {
          say("live updates paused; retrying");
          next(BACKOFF_MS);
        });
    }
    say("live");
    poll();
  }

  function preview(link) {
    var idx = link.getAttribute("data-idx");
    var row = document.getElementById("preview-" + idx);
    if (!row) { return; }
    if (!row.hidden && row.getAttribute("data-loaded") === "1") {
      row.hidden = true;
      return;
    }
    var pre = row.querySelector(".t-preview");
    var note = row.querySelector(".t-preview-note");
    fetch(link.getAttribute("data-preview-url"), { cache: "no-store", credentials: "same-origin" })
      .then(function (resp) {
        if (!resp.ok) { throw new Error("HTTP " + resp.status); }
        var total = parseInt(resp.headers.get("X-Result-Bytes") || "0", 10);
        return resp.text().then(function (body) { return [body, total]; });
      })
      .then(function (got) {
        pre.textContent = got[0];
        var shown = new TextEncoder().encode(got[0]).length;
        note.textContent = "content is " + size(got[1]) +
          (got[1] > shown ? "; the first " + size(shown) + " are shown" : "");
        row.setAttribute("data-loaded", "1");
        row.hidden = false;
      })
      .catch(function (err) {
        pre.textContent = "";
        note.textContent = "could not load the result (" + err.message + ")";
        row.hidden = false;
      });
  }

  document.addEventListener("click", function (ev) {
    var link = ev.target.closest ? ev.target.closest("a.preview-link") : null;
    if (!link) { return; }
    ev.preventDefault();
    preview(link);
  });

  var url = document.body.getAttribute("data-progress-url");
  if (url && document.body.getAttribute("data-finished") !== "1") {
    follow(url);
  }
})();
