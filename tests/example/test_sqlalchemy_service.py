"""The SQLAlchemy checkout service, on the shop's own tables, beside the Django one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from sqlalchemy import Engine
from sqlalchemy.engine import URL

from advisory_locks import LockNotAcquired
from advisory_locks_django import advisory_lock
from tests.django.support import run_in_thread
from tests.example.conftest import django_db

pytestmark = django_db


@pytest.fixture
def engine(shop_db: str) -> Iterator[Engine]:
    """An engine on the same test database the Django shop uses in this test."""
    from sqlalchemy_service import shop_engine

    database = connections[shop_db].settings_dict
    if connections[shop_db].vendor == "sqlite":
        url = URL.create("sqlite", database=database["NAME"])
    else:
        url = URL.create(
            "postgresql+psycopg",
            username=database["USER"] or None,
            password=database["PASSWORD"] or None,
            host=database["HOST"] or None,
            port=int(database["PORT"]) if database["PORT"] else None,
            database=database["NAME"],
        )
    engine = shop_engine(url.render_as_string(hide_password=False), pool_size=10)
    yield engine
    engine.dispose()


def make_product(stock: int) -> Any:
    from shop.models import Product

    return Product.objects.create(sku="mug", name="Mug", price_cents=1000, stock=stock)


def test_service_sells_and_records_the_order_in_the_shop_tables(engine: Engine) -> None:
    from shop.models import Order
    from sqlalchemy_service import CheckoutService

    product = make_product(stock=2)
    order_id = CheckoutService(engine, payment_latency=0).place_order(
        "mug", quantity=1, customer="ann@example.com", card="tok_visa"
    )
    order = Order.objects.get(pk=order_id)  # read back through Django
    assert (order.product_id, order.quantity) == (product.pk, 1)
    product.refresh_from_db()
    assert product.stock == 1


def test_service_never_sells_more_than_the_stock_to_concurrent_buyers(engine: Engine) -> None:
    from shop.models import Order
    from sqlalchemy_service import CheckoutService, OutOfStock

    product = make_product(stock=3)
    service = CheckoutService(engine, payment_latency=0.002)
    buyers = 8
    start = threading.Barrier(buyers)

    def buyer(number: int) -> str:
        start.wait()
        try:
            service.place_order(
                "mug", quantity=1, customer=f"b{number}@example.com", card="tok_visa"
            )
        except OutOfStock:
            return "out of stock"
        return "sold"

    threads = [run_in_thread(lambda n=n: buyer(n)) for n in range(buyers)]
    outcomes = sorted(thread.get(timeout=60) for thread in threads)
    assert outcomes == ["out of stock"] * 5 + ["sold"] * 3
    assert Order.objects.filter(product=product).count() == 3
    product.refresh_from_db()
    assert product.stock == 0


def test_service_waits_for_the_django_checkout_of_the_same_product(
    shop_db: str, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlalchemy_service

    make_product(stock=2)
    monkeypatch.setattr(sqlalchemy_service, "CHECKOUT_LOCK_TIMEOUT", 0.2)
    held, done = threading.Event(), threading.Event()

    def django_checkout() -> None:  # the Django shop, mid-checkout of the same product
        with advisory_lock("checkout-mug", using=shop_db):
            held.set()
            done.wait(30)

    holder = run_in_thread(django_checkout)
    assert held.wait(30)
    try:
        with pytest.raises(LockNotAcquired):
            sqlalchemy_service.CheckoutService(engine, payment_latency=0).place_order(
                "mug", quantity=1, customer="ann@example.com", card="tok_visa"
            )
    finally:
        done.set()
        holder.get()
