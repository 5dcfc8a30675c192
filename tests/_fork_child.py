"""A process for tests/test_store.py's fork test: opens a store, then forks.

``python tests/_fork_child.py URL`` opens the store at ``URL`` (emptied beforehand by the
test), stores one job, then forks while another thread holds the group writer's connection
in a transaction (as a batch being committed at the fork would). The child, within 20 s
(an alarm kills it otherwise), stores a job of its own on connections of its own and exits
the normal way, so the interpreter's finalizers run on everything it inherited. The parent
then releases its thread, waits for the child and stores another job on the same writer
connection as before the fork, which must still be the same open session, and beats on
the control pool's connection, which must still be open too.

Prints ``child ok`` (from the child) and ``parent ok``; exits 0 when both went right.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import sys
import threading
import warnings

import dcache

TTL = dt.timedelta(hours=1)


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def store_job(db: dcache.DB, tag: str) -> None:
    job_id = f"{tag}-{os.getpid()}-{now().timestamp()}"
    db.submit(
        job_id=job_id,
        caller=f"{tag}-{os.getpid()}",
        caller_class="fork",
        idem_key=job_id,
        targets=[dcache.NewTarget(f"https://example.com/{tag}/{i}", "{}") for i in range(3)],
        ttl=TTL,
        jobs_per_caller=1,
        jobs_total=100,
        now=now(),
    )
    with db.writer() as writer:
        for i in range(3):
            writer.write_target(job_id, i, status="done", result="{}", ttl=TTL, now=now())
    found = db.get_job_with_targets(job_id)
    assert found is not None and found[0].status == "done", found


def main(url: str) -> int:
    db = dcache.DB.open(url)
    store_job(db, "before")
    db.heartbeat("parent", now=now())  # the control pool keeps an idle connection
    group = db._group
    parents = group._conn
    assert parents is not None
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with group.transaction():  # the writer's connection, in a transaction, locked
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    holding.wait()
    with warnings.catch_warnings():  # Python 3.12+: fork() of a process with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a child blocked on the parent's lock is killed, not awaited
        store_job(db, "child")
        assert group._conn is not None and group._conn is not parents
        print("child ok", flush=True)
        sys.exit(0)  # the normal way: finalizers run on what the child inherited
    release.set()
    holder.join()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(f"child exit {code}", flush=True)
        return 1
    store_job(db, "after")
    # The parent's session outlived the child: same connection, never invalidated.
    assert group._conn is parents and not parents.invalidated
    # And so did the control pool's: the child closed it (a terminate message on the
    # parent's session), and the next heartbeat failed as a lost connection.
    db.heartbeat("parent", now=now())
    assert [o.owner for o in db.owners()] == ["parent"]
    db.close()
    print("parent ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
