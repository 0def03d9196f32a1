"""``make run``'s process runner: honcho, with enough grace for Celery's warm shutdown.

On Ctrl-C (SIGINT) or SIGTERM honcho sends SIGTERM to every process, then SIGKILLs whatever is
still running 5 s after the first one exited. gunicorn exits at once, but a Celery worker on the
embedded broker needs about 6 s: its loop notices the signal only between 2 s broker polls, and
then it waits for its pool. Killing it there would be an unclean stop (with late acks the task in
hand is redelivered, but the log says "lost"). Usage: ``python -m nodepool.procfile start``.
"""

from __future__ import annotations

import honcho.manager
from honcho.command import main

GRACE_SECONDS = 30

if __name__ == "__main__":
    honcho.manager.KILL_WAIT = GRACE_SECONDS
    main()
