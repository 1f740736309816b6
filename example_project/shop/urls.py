from __future__ import annotations

from django.urls import path

from shop import views

urlpatterns = [
    path("checkout/<str:sku>/", views.checkout, name="checkout"),
    path("webhooks/payments/", views.payment_webhook, name="payment-webhook"),
]
