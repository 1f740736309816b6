"""The URLs `checkout_race` serves: the shop's, plus the checkout without its lock.

The unlocked checkout exists to be compared with the real one and is never part of the
shop's own URLs (shopsite/urls.py).
"""

from __future__ import annotations

from django.urls import include, path

from shop import views

urlpatterns = [
    path(
        "race/checkout-without-lock/<str:sku>/",
        views.checkout_without_lock,
        name="checkout-without-lock",
    ),
    path("", include("shop.urls")),
]
