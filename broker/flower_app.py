"""The Celery app for Celery's own command line: ``celery -A broker.flower_app flower``
(also ``inspect``, ``status``, ``purge``).

``celery --broker URL flower`` can carry a broker URL but no transport options, and a
Sentinel group needs one (``master_name``, see ``broker.sentinel``). Built from the same
``TOKENRELAY_*`` settings as every other process, this app brings the broker URL, the
result backend and their options for a plain Redis and a Sentinel group alike, on
Celery's own Redis when ``TOKENRELAY_CELERY_URL`` names one (``celery_redis_url``). It is
created at import because that is how ``celery -A`` finds an app; nothing in tokenrelay
imports this module.

Importing it also sets up JSON logs when ``log_format`` asks for them (``flower_logs``),
and puts Flower's ``/metrics`` behind Flower's own authentication: Flower
2.x serves its UI and API only with the basic auth (or OAuth) it is started with, but
``/metrics`` (task names, worker names, queue and task counts) to anyone.
"""

from __future__ import annotations

from typing import Any

from app import logs
from app.settings import Settings
from broker.celery_app import create_celery


def require_auth_for_flower_metrics() -> bool:
    """Wrap Flower's ``/metrics`` handler in tornado's ``authenticated``, as Flower does
    its other views: with basic auth configured, a request without the credentials is
    401 (``get_current_user`` raises it). False when Flower is not installed."""
    try:
        import tornado.web
        from flower.views import monitor
    except ImportError:
        return False
    get: Any = monitor.Metrics.get
    if not getattr(get, "_tokenrelay_authenticated", False):
        guarded: Any = tornado.web.authenticated(get)
        guarded._tokenrelay_authenticated = True
        monitor.Metrics.get = guarded
    return True


def flower_celery(settings: Settings) -> Any:
    """The app Flower runs with: every model's queues are on its broker page because it
    lists what the live workers consume. It talks to Redis through kombu's own
    transports: Flower names its broker client by the URL's scheme (``redis``,
    ``sentinel``), and ours (``broker.kombu_redis``, a per-command saving that Flower
    does not need) would make its queue page and ``/api/queues/length`` a 404."""
    celery = create_celery(settings)
    celery.conf.broker_transport = None
    return celery


def flower_logs(settings: Settings) -> None:
    """With ``log_format`` json, Flower's lines (its own, tornado's, Celery's) are JSON
    lines too: the root logger gets ``app.logs``' handler before Flower parses its
    options, and tornado then adds none of its own (it only does to a bare root).
    Text: tornado's format, as always."""
    if settings.log_format == "json":
        logs.configure("flower", "INFO", "json")


require_auth_for_flower_metrics()
_settings = logs.settings_or_exit("flower")
flower_logs(_settings)
app = flower_celery(_settings)
