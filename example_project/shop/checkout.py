"""The checkout: read the stock, price the order, charge the card, write the order.

Between the read and the write there is real work (a query for the customer's order
history, the price, a call to the payment provider), as in any shop. Two buyers of the
last item who both read ``stock = 1`` before either writes will both be sold it, unless
the read-decide-write runs under a lock named after the product.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction

from shop.locking import has_transaction_locks, shop_database
from shop.models import Order, Product
from shop.payments import authorize_payment, quote

__all__ = ["CHECKOUT_LOCK_TIMEOUT", "OutOfStock", "Purchase", "place_order"]

logger = logging.getLogger(__name__)

# Seconds a buyer waits for the buyers ahead of it on the same product before the view
# answers 503 ("busy, try again").
CHECKOUT_LOCK_TIMEOUT = 10


class OutOfStock(Exception):
    pass


@dataclass(frozen=True)
class Purchase:
    sku: str
    quantity: int
    customer: str
    card_token: str


def place_order(purchase: Purchase, *, lock: bool = True) -> Order:
    """Sell ``purchase`` or raise OutOfStock / Product.DoesNotExist / PaymentDeclined.

    ``lock=False`` is the same code without the lock: the bug that ``checkout_race``
    demonstrates. Nothing else calls it that way.
    """
    if not lock:
        return _sell(purchase)
    using = shop_database()
    with Product.objects.with_advisory_lock(
        f"checkout-{purchase.sku}",
        # A transaction lock where the database has one (PostgreSQL), else a session lock
        # around the write transaction: see shop/locking.py for why both are correct.
        transaction=has_transaction_locks(using),
        timeout=CHECKOUT_LOCK_TIMEOUT,
    ):
        return _sell(purchase)


def _sell(purchase: Purchase) -> Order:
    product = Product.objects.get(sku=purchase.sku)
    if product.stock < purchase.quantity:
        raise OutOfStock(f"{product.sku}: {product.stock} left, {purchase.quantity} wanted")
    returning = Order.objects.filter(customer=purchase.customer).exists()
    total = quote(product.price_cents, purchase.quantity, returning_customer=returning)
    payment = authorize_payment(purchase.card_token, total, latency=settings.SHOP_PAYMENT_LATENCY)
    with transaction.atomic(using=shop_database()):
        product.stock -= purchase.quantity
        product.save(update_fields=["stock"])
        order = Order.objects.create(
            product=product,
            customer=purchase.customer,
            quantity=purchase.quantity,
            total_cents=total,
            payment_id=payment.id,
        )
    logger.debug("order %s: %s x %s", order.pk, purchase.quantity, product.sku)
    return order
