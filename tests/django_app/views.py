"""Views that run what a test registered, so a test can put any code inside a real request
(request_started, the view, request_finished, Django's close_old_connections())."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from django.http import HttpRequest, HttpResponse

# Registered by tests/django/real_requests.py; a job's return value is the response body.
JOBS: dict[str, Callable[[], Any]] = {}


def run_job(request: HttpRequest, job: str) -> HttpResponse:
    return HttpResponse(repr(JOBS.pop(job)()))


async def run_async_job(request: HttpRequest, job: str) -> HttpResponse:
    coroutine: Awaitable[Any] = JOBS.pop(job)()
    return HttpResponse(repr(await coroutine))
