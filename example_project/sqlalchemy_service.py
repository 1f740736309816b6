"""The shop's checkout written with SQLAlchemy: the same tables, the same lock names.

A service that shares the database with the Django shop (a worker, another API) and
sells through this module excludes, and is excluded by, the Django checkout: both lock
``checkout-<sku>`` with the same key scheme. The schema is Django's (shop/migrations).

    from sqlalchemy_service import CheckoutService, shop_engine

    service = CheckoutService(shop_engine("postgresql+psycopg://app@db/shop"))
    order_id = service.place_order("mug", quantity=1, customer="a@example.com", card="tok_visa")

The lock mode follows shop/locking.py: a transaction lock on PostgreSQL, released by the
commit; elsewhere a session lock taken before the transaction begins and released after
it commits. ``AdvisoryLockSession`` holds a Session's session locks on a pooled
connection of their own, so the Session's commit never touches them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import DateTime, Engine, ForeignKey, String, create_engine, event, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from advisory_locks.sqlalchemy import AdvisoryLockSession
from shop.payments import authorize_payment, quote
from shopsite.database_url import sqlalchemy_url

__all__ = ["CheckoutService", "Order", "OutOfStock", "Product", "shop_engine"]

CHECKOUT_LOCK_TIMEOUT = 10
SQLITE_BUSY_TIMEOUT = 30


class OutOfStock(Exception):
    pass


class Base(DeclarativeBase):
    pass


class Product(Base):
    __tablename__ = "shop_product"

    id: Mapped[int] = mapped_column(primary_key=True)
    sku: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    price_cents: Mapped[int]
    stock: Mapped[int]
    units_sold: Mapped[int | None]


class Order(Base):
    __tablename__ = "shop_order"

    id: Mapped[int] = mapped_column(primary_key=True)
    product_id: Mapped[int] = mapped_column(ForeignKey("shop_product.id"))
    customer: Mapped[str] = mapped_column(String(254))
    quantity: Mapped[int]
    total_cents: Mapped[int]
    payment_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="paid")
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=lambda: datetime.now(timezone.utc)
    )


def shop_engine(url: str, **options: Any) -> Engine:
    """An engine for the shop's database, with the SQLite settings the Django side uses.

    A plain ``mysql://`` or ``postgresql://`` URL gets the driver that is installed.
    """
    if url.startswith("sqlite"):
        options.setdefault("connect_args", {}).setdefault("timeout", SQLITE_BUSY_TIMEOUT)
    engine = create_engine(sqlalchemy_url(url), **options)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _use_wal)
    return engine


def _use_wal(dbapi_connection: Any, connection_record: Any) -> None:
    # As shop/apps.py: readers and one writer at a time instead of readers blocking writers.
    dbapi_connection.execute("PRAGMA journal_mode=WAL")


class CheckoutService:
    """Sells products under the lock ``checkout-<sku>``."""

    def __init__(self, engine: Engine, *, payment_latency: float = 0.005) -> None:
        self.sessions = sessionmaker(engine, class_=AdvisoryLockSession)
        self.payment_latency = payment_latency
        # See shop/locking.py: only PostgreSQL releases a lock at COMMIT.
        self.transaction_locks = engine.dialect.name == "postgresql"

    def place_order(self, sku: str, *, quantity: int, customer: str, card: str) -> int:
        """Sell and return the new order's id; raises OutOfStock or PaymentDeclined."""
        with self.sessions() as session, self._locked_transaction(session, f"checkout-{sku}"):
            product = session.scalars(select(Product).where(Product.sku == sku)).one()
            if product.stock < quantity:
                raise OutOfStock(f"{sku}: {product.stock} left, {quantity} wanted")
            returning = session.scalar(select(Order.id).where(Order.customer == customer).limit(1))
            total = quote(product.price_cents, quantity, returning_customer=returning is not None)
            payment = authorize_payment(card, total, latency=self.payment_latency)
            product.stock -= quantity
            order = Order(
                product_id=product.id,
                customer=customer,
                quantity=quantity,
                total_cents=total,
                payment_id=payment.id,
            )
            session.add(order)
            session.flush()
            return order.id

    @contextlib.contextmanager
    def _locked_transaction(self, session: AdvisoryLockSession, name: str) -> Iterator[None]:
        if self.transaction_locks:
            # Released by the commit at the end of session.begin(), not by the inner block.
            with (
                session.begin(),
                session.advisory_lock(name, transaction=True, timeout=CHECKOUT_LOCK_TIMEOUT),
            ):
                yield
        else:
            # Taken before the transaction begins, released after it has committed.
            with session.advisory_lock(name, timeout=CHECKOUT_LOCK_TIMEOUT), session.begin():
                yield
