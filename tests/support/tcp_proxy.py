"""A loopback TCP proxy a test can cut and restore: a broker outage without stopping the broker.

`cut()` drops every proxied connection and refuses new ones (the port is closed), which is what
a client sees when its broker dies (`cut(reset=True)`: with a TCP reset, as when the broker's
host drops the connection, rather than a clean close); `restore()` listens again on the same
port. The broker
itself — a machine-wide service other tests share — is never touched.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType

ACCEPT_POLL_S = 0.1
CHUNK_BYTES = 65536


class TcpProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self.port = self._listen(0)

    def _listen(self, port: int) -> int:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, port))
        listener.listen(64)
        listener.settimeout(ACCEPT_POLL_S)
        self._stop = threading.Event()
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener, self._stop), daemon=True).start()
        return int(listener.getsockname()[1])

    def _accept(self, listener: socket.socket, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection((self.host, self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(CHUNK_BYTES):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(src, dst)

    def _drop(self, *socks: socket.socket, reset: bool = False) -> None:
        for sock in socks:
            with contextlib.suppress(OSError):
                if reset:  # linger 0: close() sends RST instead of FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with self._lock:
                self._sockets.discard(sock)

    def cut(self, *, reset: bool = False) -> None:
        """Drop every connection and stop listening (new connections are refused)."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            socks = list(self._sockets)
        self._drop(*socks, reset=reset)

    def restore(self) -> None:
        self._listen(self.port)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cut()
