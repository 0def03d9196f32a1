"""django-fsm-2 helpers shared by the apps' state machines.

django-fsm-2's ``FSMModelMixin.refresh_from_db`` (which ``ConcurrentTransitionMixin`` inherits)
lifts the ``protected`` flag on the *field object*, shared by every instance in the process, for the
length of the reload, and sets it back afterwards. Two threads refreshing instances of one model at
once (a deferred field loaded on first access is a refresh too) interleave: the one that finishes
first re-protects the field while the other is still assigning it, and that one fails with
``AttributeError: Direct lifecycle modification is not allowed``. Seen in the threaded race tests and
the live-server end-to-end tests (marketplace availability loading a deferred node field during a
status report). Gunicorn's sync workers are single-threaded, but Celery thread pools and gthread
workers are not.
"""

from __future__ import annotations

import threading

from django_fsm import FSMModelMixin

# One lock for every protected-FSM model: the flag lives on each model's field, but refreshes are
# short (one SELECT by primary key, which takes no row lock), so one lock costs nothing measurable.
_REFRESH = threading.RLock()


class SerializedFSMRefresh(FSMModelMixin):
    """Put first in the bases of every model with a protected ``FSMField`` (a test checks): gives it
    django-fsm's ``refresh_from_db`` (without which a refresh of a loaded protected field always
    fails) and serializes that method's flag toggling across threads. Same signature and errors as
    Django's ``Model.refresh_from_db``."""

    def refresh_from_db(self, *args, **kwargs):
        with _REFRESH:
            super().refresh_from_db(*args, **kwargs)
