"""Soak through the Django app on PostgreSQL: random locks around atomic() blocks.

Threads (each with its own Django connection) take session and transaction locks with
``advisory_locks_django.advisory_lock``, commit, roll back and raise inside the blocks,
take transaction locks in savepoints that roll back, and increment a counter row under a
lock. While every thread's connection is still open, ``pg_locks`` must show no advisory
lock in the test database, and the counter must have lost no update.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable

import pytest
from django.db import connections, transaction
from sqlalchemy.engine import URL

from advisory_locks_django import advisory_lock
from tests.databases import advisory_locks_held
from tests.django.conftest import admin_for
from tests.django_app.models import Product
from tests.faults.conftest import finish_soak
from tests.faults.test_soak import SEED, Boom, RandomMix
from tests.helpers import unique_name

pytestmark = [pytest.mark.faults, pytest.mark.slow]

OPERATIONS = int(os.environ.get("ADVISORY_LOCKS_DJANGO_SOAK_OPERATIONS", "1000"))
THREADS = 4
TIMEOUTS = [0, 0.01, 0.2]
JOIN_SECONDS = 300.0


class DjangoSoak(RandomMix):
    def __init__(self, product_id: int) -> None:
        super().__init__()
        self.product_id = product_id
        self.names = [unique_name(f"django-soak-{index}") for index in range(4)]
        self.counter_name = unique_name("django-soak-counter")

    def session_lock(self, rng: random.Random) -> str:
        with advisory_lock(rng.choice(self.names), timeout=rng.choice(TIMEOUTS)) as lock:
            if rng.random() < 0.5:
                with transaction.atomic():
                    Product.objects.filter(pk=self.product_id).exists()
                    transaction.set_rollback(rng.random() < 0.5)
            lock.ensure_held()
            if rng.random() < 0.2:
                raise Boom
        return "session lock around atomic()"

    def transaction_lock(self, rng: random.Random) -> str:
        outcome = "transaction lock in atomic()"
        with transaction.atomic():
            with advisory_lock(
                rng.choice(self.names), transaction=True, timeout=rng.choice(TIMEOUTS)
            ):
                if rng.random() < 0.4:
                    try:
                        with transaction.atomic():  # a savepoint
                            granted = advisory_lock(
                                rng.choice(self.names), transaction=True, timeout=0
                            ).acquire()
                            outcome += f", savepoint ({'granted' if granted else 'busy'})"
                            raise Boom  # rolls the savepoint back, and its lock with it
                    except Boom:
                        pass
            if rng.random() < 0.2:
                raise Boom
            transaction.set_rollback(rng.random() < 0.3)
        return outcome

    def own_transaction_lock(self, rng: random.Random) -> str:
        # No atomic() open: the lock opens one and commits it at the block's end.
        with advisory_lock(rng.choice(self.names), transaction=True, timeout=rng.choice(TIMEOUTS)):
            if rng.random() < 0.2:
                raise Boom
        return "transaction lock opening its own atomic()"

    def increment(self, rng: random.Random) -> str:
        counter = Product.objects.filter(pk=self.product_id)
        if rng.random() < 0.5:
            with transaction.atomic(), advisory_lock(self.counter_name, transaction=True):
                stock = counter.values_list("stock", flat=True).get()
                counter.update(stock=stock + 1)
            self.record("counter incremented under a transaction lock", increments=1)
            return ""
        # Read and write in separate autocommit statements: only the lock keeps another
        # thread from writing in between.
        with advisory_lock(self.counter_name):
            stock = counter.values_list("stock", flat=True).get()
            counter.update(stock=stock + 1)
        self.record("counter incremented under a session lock", increments=1)
        return ""

    def operations(self) -> list[Callable[[random.Random], str]]:
        return [
            self.session_lock,
            self.transaction_lock,
            self.own_transaction_lock,
            self.increment,
        ]


@pytest.mark.django_db(transaction=True)
def test_django_soak_leaves_no_lock_in_pg_locks_and_loses_no_update(postgres_url: URL) -> None:
    product = Product.objects.create(sku=unique_name("sku")[-40:], stock=0)
    soak = DjangoSoak(product.pk)
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS, timeout=60)
    finished = threading.Barrier(THREADS + 1, timeout=JOIN_SECONDS)
    checked = threading.Event()

    def worker(index: int) -> None:
        try:
            start.wait()
            soak.run_share(index, THREADS, OPERATIONS)
        except BaseException as error:  # reported by the main thread
            errors.append(error)
        finally:
            # Connections stay open until the main thread has looked at pg_locks.
            finished.wait()
            checked.wait(JOIN_SECONDS)
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    try:
        finished.wait()
        for admin in admin_for(postgres_url):
            leaked = advisory_locks_held(admin)
    finally:
        checked.set()
    for thread in threads:
        thread.join(JOIN_SECONDS)
    assert errors == []

    product.refresh_from_db()
    finish_soak(
        f"Django soak on postgresql (seed {SEED}, {THREADS} threads, {soak.increments} increments)",
        soak.outcomes,
        planned=OPERATIONS,
        leaked=list(leaked),
        lost_updates=soak.increments - product.stock,
    )
