"""A shop: products with a stock count, orders, and the records that keep jobs honest."""

from __future__ import annotations

from django.db import models

from advisory_locks_django import AdvisoryLockManager


class Product(models.Model):
    sku = models.CharField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    price_cents = models.PositiveIntegerField()
    stock = models.IntegerField()
    # Filled by the boot-time backfill (shop/boot.py), kept up to date afterwards.
    units_sold = models.IntegerField(null=True, blank=True)

    objects = AdvisoryLockManager["Product"]()

    def __str__(self) -> str:
        return self.sku


class Order(models.Model):
    class Status(models.TextChoices):
        PAID = "paid"
        REFUNDED = "refunded"

    product = models.ForeignKey(Product, on_delete=models.PROTECT, related_name="orders")
    customer = models.EmailField()
    quantity = models.PositiveIntegerField()
    total_cents = models.PositiveIntegerField()
    payment_id = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PAID)
    created_at = models.DateTimeField(auto_now_add=True)


class WebhookEvent(models.Model):
    """One row per payment-provider event handled: the durable idempotency record."""

    event_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=100)
    received_at = models.DateTimeField(auto_now_add=True)

    objects = AdvisoryLockManager["WebhookEvent"]()


class SalesReport(models.Model):
    """Written by the `sales_report` cron command; two rows for one run is the bug."""

    orders = models.PositiveIntegerField()
    units = models.PositiveIntegerField()
    revenue_cents = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)


class BackfillRun(models.Model):
    """A boot-time backfill that has finished, so later boots skip it."""

    name = models.CharField(max_length=100, unique=True)
    finished_at = models.DateTimeField(auto_now_add=True)


class FeedItem(models.Model):
    """An item of a supplier's feed, waiting to be checked (the `feed_checker` job)."""

    feed = models.CharField(max_length=100)
    number = models.PositiveIntegerField()
    checked = models.BooleanField(default=False)


class FeedCheck(models.Model):
    """One check of a feed item, with the lease token of the worker that made it. Two rows
    for one item is the bug that fence() prevents (deliberately no unique constraint)."""

    item = models.ForeignKey(FeedItem, on_delete=models.CASCADE, related_name="checks")
    worker = models.CharField(max_length=100)
    token = models.BigIntegerField()
    checked_at = models.DateTimeField(auto_now_add=True)
