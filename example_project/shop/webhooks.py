"""Payment-provider webhooks, processed once however often and however concurrently they
are delivered.

Providers deliver at least once, and retry while the first delivery may still be
running. Two things together make the handler idempotent:

- a unique row per event id (``WebhookEvent``), written in the same transaction as the
  event's effect: the durable "already handled" record that every later retry finds;
- a lock named after the event id around that transaction, so a retry arriving while the
  first delivery runs waits for its commit and then finds the row, instead of repeating
  the effect and failing on the unique constraint only at the end.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import F

from shop.locking import has_transaction_locks, shop_database
from shop.models import Order, Product, WebhookEvent
from shop.payments import sign_webhook

__all__ = ["BadSignature", "Event", "handle_event", "verify_signature"]

WEBHOOK_LOCK_TIMEOUT = 30
SIGNATURE_TOLERANCE_SECONDS = 300


class BadSignature(Exception):
    pass


@dataclass(frozen=True)
class Event:
    id: str
    type: str
    data: dict[str, Any]


def verify_signature(payload: bytes, header: str, secret: str) -> None:
    """Check the provider's ``t=...,v1=...`` signature header (constant-time compare)."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        raise BadSignature("malformed signature header") from None
    if abs(time.time() - timestamp) > SIGNATURE_TOLERANCE_SECONDS:
        raise BadSignature("signature timestamp outside the tolerance")
    expected = sign_webhook(payload, secret, timestamp)
    if not hmac.compare_digest(expected, header):
        raise BadSignature("signature mismatch")


def handle_event(event: Event) -> str:
    """Apply ``event`` once; returns ``"processed"`` or ``"duplicate"``."""
    using = shop_database()
    with (
        WebhookEvent.objects.with_advisory_lock(
            f"webhook-{event.id}",
            transaction=has_transaction_locks(using),  # see shop/locking.py
            timeout=WEBHOOK_LOCK_TIMEOUT,
        ),
        transaction.atomic(using=using),
    ):
        if WebhookEvent.objects.filter(event_id=event.id).exists():
            return "duplicate"
        # The record and the effect commit together, or not at all.
        WebhookEvent.objects.create(event_id=event.id, type=event.type)
        _apply(event)
    return "processed"


def _apply(event: Event) -> None:
    if event.type == "charge.refunded":
        # Restocking twice for one refund is the classic double-processing bug.
        order = Order.objects.select_related("product").get(payment_id=event.data["payment"])
        if order.status != Order.Status.REFUNDED:
            order.status = Order.Status.REFUNDED
            order.save(update_fields=["status"])
            Product.objects.filter(pk=order.product_id).update(stock=F("stock") + order.quantity)
    # Other event types are acknowledged and recorded, nothing more.
