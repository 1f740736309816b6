"""Models for the Django app's tests (no migrations: the test runner creates the tables)."""

from __future__ import annotations

from django.db import models

from advisory_locks_django import (
    AdvisoryLockManager,
    AdvisoryLockManagerMixin,
    AdvisoryLockQuerySet,
    AdvisoryLockQuerySetMixin,
)


class Product(models.Model):
    sku = models.CharField(max_length=40, unique=True)
    stock = models.IntegerField()

    objects = AdvisoryLockManager["Product"]()


class Order(models.Model):
    product = models.ForeignKey(Product, on_delete=models.CASCADE)


class OwnQuerySet(AdvisoryLockQuerySetMixin, models.QuerySet["Invoice"]):
    pass


class OwnManager(AdvisoryLockManagerMixin, models.Manager["Invoice"]):
    pass


class Invoice(models.Model):
    number = models.IntegerField()

    objects = OwnManager()
    as_queryset = OwnQuerySet.as_manager()
    plain = AdvisoryLockQuerySet["Invoice"].as_manager()


class LedgerEntry(models.Model):
    """Routed to the "other" database for writes."""

    amount = models.IntegerField()

    objects = AdvisoryLockManager["LedgerEntry"]()
