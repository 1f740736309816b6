"""The URLs the request-level tests call: each runs a job a test registered."""

from __future__ import annotations

from django.urls import path

from tests.django_app import views

urlpatterns = [
    path("job/<str:job>/", views.run_job),
    path("async-job/<str:job>/", views.run_async_job),
]
