"""A TCP proxy in front of a database server that a test can cut and restore, or whose
open connections it can stall: the network failures a renewer must survive, without
touching the shared server."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from types import TracebackType


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._stalled: set[socket.socket] = set()
        self._open = True
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stopped = True
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()

    def cut(self) -> None:
        """Kill every connection through the proxy and refuse new ones."""
        with self._lock:
            self._open = False
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
            self._sockets.clear()

    def stall(self) -> None:
        """Stop forwarding on every open connection, without closing it: whatever is sent
        is neither answered nor refused, as through a partition or to a hung server (or
        an old primary after a failover). New connections still go through."""
        with self._lock:
            self._stalled.update(self._sockets)

    def restore(self) -> None:
        with self._lock:
            self._open = True

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _address = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if not self._open:
                    client.close()
                    continue
                try:
                    server = socket.create_connection(self._target, timeout=5)
                except OSError:
                    client.close()
                    continue
                self._sockets.update((client, server))
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()

    def _pipe(self, client: socket.socket, server: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        peers = {client: server, server: client}
        try:
            for sock in peers:
                selector.register(sock, selectors.EVENT_READ)
            while True:
                if client in self._stalled:
                    if client.fileno() < 0:
                        return
                    time.sleep(0.05)
                    continue
                for key, _mask in selector.select(timeout=0.5):
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = source.recv(65536)
                    if not data:
                        return
                    peers[source].sendall(data)
                if client.fileno() < 0 or server.fileno() < 0:
                    return
        except (OSError, ValueError):
            return
        finally:
            selector.close()
            for sock in peers:
                with contextlib.suppress(OSError):
                    sock.close()
            with self._lock:
                self._sockets.difference_update(peers)
                self._stalled.difference_update(peers)
