"""Fleet Celery tasks: thin wrappers over :mod:`fleet.admission` (dispatched with ``on_commit``)."""

from __future__ import annotations

from celery import shared_task
from django.db import OperationalError

from .events import Actor


@shared_task(
    name="fleet.run_admission",
    bind=True,
    acks_late=True,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=5,
)
def run_admission(self, node_id: str, attempt: int) -> str:
    """Run or resume admission attempt ``attempt`` of node ``node_id`` (idempotent)."""
    from .admission import run_admission as run

    return run(node_id=node_id, attempt=attempt, actor=Actor.system("fleet.run_admission", self.request.id or ""))


@shared_task(name="fleet.expire_benchmarks", bind=True)
def expire_benchmarks(self) -> int:
    """Beat: time out benchmarks past their deadline and fail their admission checks."""
    from .admission import benchmarks_expire

    return benchmarks_expire(actor=Actor.system("fleet.expire_benchmarks", self.request.id or ""))


@shared_task(name="fleet.resume_stalled_admissions")
def resume_stalled_admissions() -> int:
    """Beat: re-dispatch admission for nodes left ``admitting`` by a lost task or a crash."""
    from .admission import admissions_resume

    return admissions_resume()
