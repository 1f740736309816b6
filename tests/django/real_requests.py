"""Real Django requests for tests: a WSGI server worker thread, one WSGI request run in
place, and one ASGI request run on the caller's event loop.

The test client keeps the test's connections open and disconnects Django's
``close_old_connections`` while it runs, which hides exactly what happens to connections
(and the locks on them) at a request's end. These go through ``WSGIHandler`` as a server
does: ``request_started``, the view, the response's ``close()`` sending
``request_finished``, and Django's connection handling around them.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import threading
import time
import wsgiref.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.wsgi import WSGIHandler
from django.db import connections

from tests.django_app.views import JOBS

__all__ = ["Response", "WSGIWorker", "asgi_request", "handle_request", "wsgi_worker"]

_job_ids = itertools.count()


@dataclass
class Response:
    status: int
    body: str
    # What the job raised (the server answered 500), or None.
    error: BaseException | None
    seconds: float


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _register(job: Callable[[], Any], errors: dict[str, BaseException]) -> str:
    job_id = f"job{next(_job_ids)}"

    def recording() -> Any:
        try:
            return job()
        except BaseException as error:
            errors[job_id] = error
            raise

    JOBS[job_id] = recording
    return job_id


def _register_async(job: Callable[[], Any], errors: dict[str, BaseException]) -> str:
    job_id = f"job{next(_job_ids)}"

    async def recording() -> Any:
        try:
            return await job()
        except BaseException as error:
            errors[job_id] = error
            raise

    JOBS[job_id] = recording
    return job_id


class WSGIWorker:
    """Django's WSGIHandler served on 127.0.0.1 by one thread, one request after another,
    as a sync worker of gunicorn or uWSGI serves them: the worker's connections live from
    request to request as ``CONN_MAX_AGE`` (or the native pool) decides."""

    def __init__(self) -> None:
        self._server = make_server("127.0.0.1", 0, WSGIHandler(), handler_class=_QuietHandler)
        self._errors: dict[str, BaseException] = {}
        self._thread = threading.Thread(target=self._serve, name="wsgi-worker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._server.serve_forever(poll_interval=0.05)
        finally:
            connections.close_all()

    def request(self, job: Callable[[], Any], *, timeout: float = 30) -> Response:
        """Run ``job`` in a sync view of the next request; its repr() is the body."""
        return self._get(f"/job/{_register(job, self._errors)}/", timeout)

    def async_request(self, job: Callable[[], Any], *, timeout: float = 30) -> Response:
        """Run the coroutine function ``job`` in an async view (Django runs it with
        async_to_sync in the worker thread, as under any WSGI server)."""
        return self._get(f"/async-job/{_register_async(job, self._errors)}/", timeout)

    def _get(self, path: str, timeout: float) -> Response:
        host, port = self._server.server_address[:2]
        started = time.monotonic()
        client = http.client.HTTPConnection(str(host), int(port), timeout=timeout)
        try:
            client.request("GET", path)
            answer = client.getresponse()
            body = answer.read().decode()
        finally:
            client.close()
        job_id = path.rstrip("/").rsplit("/", 1)[-1]
        return Response(
            answer.status, body, self._errors.pop(job_id, None), time.monotonic() - started
        )

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(30)
        self._server.server_close()


@contextmanager
def wsgi_worker() -> Iterator[WSGIWorker]:
    worker = WSGIWorker()
    try:
        yield worker
    finally:
        worker.stop()


def handle_request(job: Callable[[], Any]) -> Response:
    """Run ``job`` in a view of one request handled in this thread, as a WSGI server
    would: WSGIHandler called with a request's environ, then the response closed."""
    errors: dict[str, BaseException] = {}
    environ: dict[str, Any] = {}
    wsgiref.util.setup_testing_defaults(environ)
    environ["PATH_INFO"] = f"/job/{_register(job, errors)}/"
    environ["HTTP_HOST"] = "127.0.0.1"
    statuses: list[str] = []
    started = time.monotonic()

    def start_response(status: str, headers: list[tuple[str, str]], *args: Any) -> Any:
        statuses.append(status)
        return lambda data: None

    result = WSGIHandler()(environ, start_response)
    try:
        body = b"".join(result).decode()
    finally:
        result.close()  # sends request_finished, as every WSGI server does
    job_id = environ["PATH_INFO"].rstrip("/").rsplit("/", 1)[-1]
    return Response(
        int(statuses[0].split()[0]), body, errors.pop(job_id, None), time.monotonic() - started
    )


async def asgi_request(job: Callable[[], Any]) -> Response:
    """Run the coroutine function ``job`` in an async view of one request handled by
    Django's ASGIHandler, as an ASGI server (uvicorn, daphne) would call it: sync work of
    the request runs in the request's own thread (asgiref's ThreadSensitiveContext)."""
    errors: dict[str, BaseException] = {}
    path = f"/async-job/{_register_async(job, errors)}/"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    body_sent = False
    disconnected = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await disconnected.wait()  # the client stays until the response is complete
        return {"type": "http.disconnect"}

    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    started = time.monotonic()
    try:
        await ASGIHandler()(scope, receive, send)
    finally:
        disconnected.set()
    status = next(m["status"] for m in messages if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    job_id = path.rstrip("/").rsplit("/", 1)[-1]
    return Response(status, body.decode(), errors.pop(job_id, None), time.monotonic() - started)
