"""The URLs the request-level tests call: each runs a job a test registered; and the admin
(for its "Database locks" page, tests/django/test_django_admin.py)."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path

from tests.django_app import views

urlpatterns = [
    path("job/<str:job>/", views.run_job),
    path("async-job/<str:job>/", views.run_async_job),
    path("admin/", admin.site.urls),
]
