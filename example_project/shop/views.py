"""The shop's JSON endpoints: checkout, and the payment provider's webhook."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from advisory_locks_django import LockNotAcquired
from shop.checkout import OutOfStock, Purchase, place_order
from shop.models import Product
from shop.payments import PaymentDeclined
from shop.webhooks import BadSignature, Event, handle_event, verify_signature

SIGNATURE_HEADER = "HTTP_PAYMENT_SIGNATURE"  # "Payment-Signature: t=...,v1=..."


@csrf_exempt
@require_POST
def checkout(request: HttpRequest, sku: str) -> JsonResponse:
    """``POST /checkout/<sku>/`` ``{"quantity": 1, "customer": "...", "card": "tok_..."}``."""
    return _checkout(request, sku, lock=True)


@csrf_exempt
@require_POST
def checkout_without_lock(request: HttpRequest, sku: str) -> JsonResponse:
    """The same checkout minus the lock. Only `checkout_race` serves it (shop/race_urls.py)."""
    return _checkout(request, sku, lock=False)


def _checkout(request: HttpRequest, sku: str, *, lock: bool) -> JsonResponse:
    try:
        body = json.loads(request.body)
        purchase = Purchase(
            sku=sku,
            quantity=int(body.get("quantity", 1)),
            customer=str(body["customer"]),
            card_token=str(body["card"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return _error(400, "expected JSON with customer, card and an optional quantity")
    if purchase.quantity < 1:
        return _error(400, "quantity must be at least 1")
    try:
        order = place_order(purchase, lock=lock)
    except Product.DoesNotExist:
        return _error(404, f"no product {sku!r}")
    except OutOfStock as error:
        return _error(409, str(error))
    except PaymentDeclined as error:
        return _error(402, str(error))
    except LockNotAcquired:
        # Too many buyers ahead on this product: the client should retry shortly.
        return _error(503, "the product is busy, try again", retry_after=1)
    return JsonResponse(
        {"order": order.pk, "total_cents": order.total_cents, "payment": order.payment_id},
        status=201,
    )


@csrf_exempt
@require_POST
def payment_webhook(request: HttpRequest) -> JsonResponse:
    """``POST /webhooks/payments/``: an event from the payment provider, signed."""
    try:
        verify_signature(
            request.body, request.META.get(SIGNATURE_HEADER, ""), settings.SHOP_WEBHOOK_SECRET
        )
    except BadSignature as error:
        return _error(400, str(error))
    try:
        payload: dict[str, Any] = json.loads(request.body)
        event = Event(id=str(payload["id"]), type=str(payload["type"]), data=payload["data"])
    except (ValueError, KeyError, TypeError):
        return _error(400, "expected an event with id, type and data")
    try:
        outcome = handle_event(event)
    except LockNotAcquired:
        # The first delivery is still running after the lock timeout: make the provider
        # retry later, when it will find the event processed.
        return _error(503, "event in progress, retry later", retry_after=5)
    # A duplicate is a success for the provider: 2xx stops its retries.
    return JsonResponse({"event": event.id, "outcome": outcome})


def _error(status: int, message: str, *, retry_after: int | None = None) -> JsonResponse:
    response = JsonResponse({"error": message}, status=status)
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    return response
