"""Fixtures for the example project's tests (example_project/, the `shop` app).

Each test runs once per database: on PostgreSQL (the "default" alias) and on SQLite (the
"sqlite" alias, a file, so its file locks work). For SQLite a router sends every shop
query, lock and transaction there, exactly as a router would in a project whose shop
lives in a second database; the shop's code finds its database through the router.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test.utils import override_settings

SHOP_DATABASES = {"postgresql": "default", "sqlite": "sqlite"}
# Every test here may touch either database; pytest-django blocks the others.
django_db = pytest.mark.django_db(transaction=True, databases=list(SHOP_DATABASES.values()))


class ShopRouter:
    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self.alias if model._meta.app_label == "shop" else None

    db_for_write = db_for_read


@pytest.fixture(params=list(SHOP_DATABASES))
def shop_db(request: pytest.FixtureRequest) -> Iterator[str]:
    """The alias the shop runs on in this test; its settings, tuned for fast tests."""
    alias = SHOP_DATABASES[request.param]
    with override_settings(
        DATABASE_ROUTERS=[ShopRouter(alias), *settings.DATABASE_ROUTERS],
        ROOT_URLCONF="shop.urls",
        SHOP_PAYMENT_LATENCY=0.002,
        SHOP_WEBHOOK_SECRET="whsec_test",
    ):
        yield alias
