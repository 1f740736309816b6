"""Settings for the example shop: one database, from DATABASE_URL or a local SQLite file."""

from __future__ import annotations

import os
from pathlib import Path

from shopsite.database_url import database_from_url

BASE_DIR = Path(__file__).resolve().parent.parent

# Local defaults so that `manage.py checkout_race` runs on a fresh checkout; a real
# deployment sets these from its environment.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = ["advisory_locks_django", "shop"]
# The shop is a JSON API called by other programs (buyers' clients, the payment
# provider's webhooks), so no sessions, CSRF or auth middleware.
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "shopsite.urls"
WSGI_APPLICATION = "shopsite.wsgi.application"

DEFAULT_SQLITE_FILE = BASE_DIR / "shop.sqlite3"
DATABASES = {
    "default": database_from_url(
        os.environ.get("DATABASE_URL") or f"sqlite:///{DEFAULT_SQLITE_FILE}"
    )
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

ADVISORY_LOCKS = {
    # Every shop lock waits at most this long unless it says otherwise; a request that
    # cannot get its lock answers 503 instead of hanging.
    "TIMEOUT": 10,
}

# The payment provider the checkout calls (see shop/payments.py): the shared secret that
# signs its webhooks, and how long its answer takes to arrive.
SHOP_WEBHOOK_SECRET = os.environ.get("SHOP_WEBHOOK_SECRET", "whsec_example_not_a_secret")
SHOP_PAYMENT_LATENCY = float(os.environ.get("SHOP_PAYMENT_LATENCY", "0.005"))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"shop": {"handlers": ["console"], "level": "INFO"}},
}
