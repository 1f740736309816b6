"""The checkout view: sells what is in stock, never more, with concurrent buyers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections
from django.test import Client

from advisory_locks_django import advisory_lock, current_advisory_locks
from tests.django.support import run_in_thread
from tests.example.conftest import django_db

pytestmark = django_db


def make_product(stock: int, sku: str = "mug") -> Any:
    from shop.models import Product

    return Product.objects.create(sku=sku, name="Mug", price_cents=1000, stock=stock)


def buy(client: Client, sku: str = "mug", customer: str = "ann@example.com") -> Any:
    return client.post(
        f"/checkout/{sku}/",
        {"customer": customer, "card": "tok_visa", "quantity": 1},
        content_type="application/json",
    )


def test_checkout_sells_one_unit_and_records_the_order(shop_db: str) -> None:
    from shop.models import Order

    product = make_product(stock=2)
    response = buy(Client())
    assert response.status_code == 201
    order = Order.objects.get(pk=response.json()["order"])
    assert (order.product_id, order.customer, order.quantity) == (product.pk, "ann@example.com", 1)
    product.refresh_from_db()
    assert product.stock == 1


def test_checkout_answers_409_when_out_of_stock(shop_db: str) -> None:
    from shop.models import Order

    make_product(stock=0)
    assert buy(Client()).status_code == 409
    assert not Order.objects.exists()


def test_checkout_of_an_unknown_product_answers_404(shop_db: str) -> None:
    assert buy(Client(), sku="no-such-thing").status_code == 404


def test_concurrent_buyers_never_get_more_than_the_stock(shop_db: str) -> None:
    from shop.models import Order

    product = make_product(stock=3)
    buyers = 8
    start = threading.Barrier(buyers)

    def buyer(number: int) -> int:
        client = Client()  # in this thread: its own database connection
        start.wait()
        status: int = buy(client, customer=f"buyer{number}@example.com").status_code
        return status

    results = [run_in_thread(lambda n=n: buyer(n)) for n in range(buyers)]
    statuses = sorted(result.get(timeout=60) for result in results)
    assert statuses == [201] * 3 + [409] * 5
    assert Order.objects.filter(product=product).count() == 3
    product.refresh_from_db()
    assert product.stock == 0


def test_checkout_holds_the_lock_in_the_mode_its_database_supports(
    shop_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # During the payment call, the lock must be held; on PostgreSQL it is a transaction
    # lock, so a transaction is open; elsewhere it is a session lock and the write
    # transaction has not begun yet.
    import shop.checkout

    seen: dict[str, Any] = {}
    authorize = shop.checkout.authorize_payment

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen["locks"] = current_advisory_locks(shop_db)
        seen["in_transaction"] = connections[shop_db].in_atomic_block
        return authorize(*args, **kwargs)

    monkeypatch.setattr(shop.checkout, "authorize_payment", spy)
    make_product(stock=1)
    assert buy(Client()).status_code == 201
    assert seen["locks"] == ["checkout-mug"]
    assert seen["in_transaction"] is (connections[shop_db].vendor == "postgresql")
    assert current_advisory_locks(shop_db) == []


def test_a_buyer_who_cannot_get_the_lock_in_time_answers_503(
    shop_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shop.checkout
    from shop.models import Order

    monkeypatch.setattr(shop.checkout, "CHECKOUT_LOCK_TIMEOUT", 0.2)
    make_product(stock=5)
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with advisory_lock("checkout-mug", using=shop_db):
            held.set()
            done.wait(30)

    holding = run_in_thread(holder)
    assert held.wait(30)
    try:
        response = buy(Client())
    finally:
        done.set()
        holding.get()
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert not Order.objects.exists()
