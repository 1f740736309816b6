"""Pricing and the payment provider, shared by the Django views and the SQLAlchemy service.

Plain Python (no Django, no SQLAlchemy), so both versions of the checkout do exactly the
same work between reading the stock and writing the order.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

__all__ = ["Payment", "PaymentDeclined", "authorize_payment", "quote", "sign_webhook"]

VAT_PERCENT = 20
RETURNING_CUSTOMER_DISCOUNT_PERCENT = 5
# The provider's API key, used to sign requests (a real one comes from the environment).
API_KEY = b"sk_test_example_not_a_secret"


class PaymentDeclined(Exception):
    pass


@dataclass(frozen=True)
class Payment:
    id: str
    amount_cents: int


def quote(unit_price_cents: int, quantity: int, *, returning_customer: bool) -> int:
    """The total to charge, VAT included, in cents."""
    net = unit_price_cents * quantity
    if returning_customer:
        net -= net * RETURNING_CUSTOMER_DISCOUNT_PERCENT // 100
    return net + net * VAT_PERCENT // 100


def authorize_payment(card_token: str, amount_cents: int, *, latency: float) -> Payment:
    """Charge the card through the (simulated) payment provider.

    The request is built and signed as a real client would; the provider's answer then
    takes ``latency`` seconds to come back. Real providers answer in 100-500 ms, so the
    example's default of a few milliseconds makes its race window smaller than a
    production checkout's, not larger.
    """
    if amount_cents <= 0:
        raise ValueError("amount must be positive")
    body = json.dumps({"amount": amount_cents, "currency": "eur", "source": card_token})
    signature = hmac.new(API_KEY, body.encode(), hashlib.sha256).hexdigest()
    time.sleep(latency)  # the round trip to the provider
    if card_token == "tok_declined":
        raise PaymentDeclined("the card was declined")
    return Payment(id=f"pay_{signature[:8]}{secrets.token_hex(6)}", amount_cents=amount_cents)


def sign_webhook(payload: bytes, secret: str, timestamp: int) -> str:
    """The provider's signature header for a webhook body: ``t=<unix time>,v1=<hmac>``."""
    signed = f"{timestamp}.".encode() + payload
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"
