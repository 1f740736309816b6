"""The payment webhook: each event is applied once, however its retries arrive."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from django.test import Client

from tests.django.support import run_in_thread
from tests.example.conftest import django_db

pytestmark = django_db

SECRET = "whsec_test"  # as the shop_db fixture configures


def paid_order(stock_after_sale: int = 4) -> Any:
    from shop.models import Order, Product

    product = Product.objects.create(
        sku="mug", name="Mug", price_cents=1000, stock=stock_after_sale
    )
    return Order.objects.create(
        product=product,
        customer="ann@example.com",
        quantity=2,
        total_cents=2400,
        payment_id="pay_123",
    )


def deliver(client: Client, event_id: str, *, secret: str = SECRET) -> Any:
    from shop.payments import sign_webhook

    body = json.dumps(
        {"id": event_id, "type": "charge.refunded", "data": {"payment": "pay_123"}}
    ).encode()
    return client.post(
        "/webhooks/payments/",
        body,
        content_type="application/json",
        headers={"Payment-Signature": sign_webhook(body, secret, int(time.time()))},
    )


def test_retries_arriving_together_are_processed_exactly_once(shop_db: str) -> None:
    from shop.models import Order, WebhookEvent

    order = paid_order(stock_after_sale=4)
    retries = 6
    start = threading.Barrier(retries)

    def retry() -> tuple[int, str]:
        client = Client()  # in this thread: its own database connection
        start.wait()
        response = deliver(client, "evt_1")
        return response.status_code, response.json()["outcome"]

    results = [run_in_thread(retry) for _ in range(retries)]
    answers = sorted(result.get(timeout=60) for result in results)
    assert answers == [(200, "duplicate")] * (retries - 1) + [(200, "processed")]
    assert WebhookEvent.objects.filter(event_id="evt_1").count() == 1
    order.refresh_from_db()
    order.product.refresh_from_db()
    assert order.status == Order.Status.REFUNDED
    assert order.product.stock == 6  # restocked once: 4 + 2


def test_a_retry_after_processing_is_acknowledged_as_a_duplicate(shop_db: str) -> None:
    order = paid_order(stock_after_sale=4)
    assert deliver(Client(), "evt_1").json()["outcome"] == "processed"
    response = deliver(Client(), "evt_1")
    assert (response.status_code, response.json()["outcome"]) == (200, "duplicate")
    order.product.refresh_from_db()
    assert order.product.stock == 6


def test_an_event_with_a_bad_signature_is_rejected_unprocessed(shop_db: str) -> None:
    from shop.models import WebhookEvent

    paid_order()
    response = deliver(Client(), "evt_1", secret="whsec_someone_else")
    assert response.status_code == 400
    assert not WebhookEvent.objects.exists()
