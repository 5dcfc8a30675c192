"""gunicorn settings for the multi-worker metrics test: the documented child_exit hook."""

from prometheus_client import multiprocess


def child_exit(server, worker):  # type: ignore[no-untyped-def]
    multiprocess.mark_process_dead(worker.pid)
