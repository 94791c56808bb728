"""The Celery app for Celery's own command line: ``celery -A broker.flower_app flower``
(also ``inspect``, ``status``, ``purge``).

``celery --broker URL flower`` can carry a broker URL but no transport options, and a
Sentinel group needs one (``master_name``, see ``broker.sentinel``). Built from the same
``TOKENRELAY_*`` settings as every other process, this app brings the broker URL, the
result backend and their options for a plain Redis and a Sentinel group alike. It is
created at import because that is how ``celery -A`` finds an app; nothing in tokenrelay
imports this module.
"""

from __future__ import annotations

from app.settings import Settings
from broker.celery_app import create_celery

app = create_celery(Settings())
