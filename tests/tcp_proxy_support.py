"""A TCP proxy a test can stop, start and hang: a real dependency (Redis, PostgreSQL) made
unreachable, or made to accept and never answer, without mocks.

    proxy = TcpProxy(6379)          # forwards 127.0.0.1:<proxy.port> -> 127.0.0.1:6379
    proxy.stop()                    # connection refused; open connections are cut
    proxy.hang()                    # accepts, and forwards nothing either way (a hung server)
    proxy.forward()                 # back to normal
    proxy.close()
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.mode = "forward"
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._listener: socket.socket | None = None
        self._listen()

    # -- modes -------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Refuse new connections and cut the open ones (a dependency that went away)."""
        self.mode = "stopped"
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        self._cut_all()

    def hang(self) -> None:
        """Accept connections and answer nothing; open connections stop forwarding too."""
        self.mode = "hang"
        if self._listener is None:
            self._listen()

    def forward(self) -> None:
        self.mode = "forward"
        if self._listener is None:
            self._listen()

    def close(self) -> None:
        self._closed = True
        self.stop()

    # -- internals ---------------------------------------------------------------------------------
    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-proxy-accept").start()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _cut_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            self._track(client)
            if self.mode == "hang":
                continue  # held open, never answered
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            self._track(upstream)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True, name="tcp-proxy-pump").start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 0.1)
                if self.mode == "hang":
                    continue  # bytes wait in the kernel's buffers: nobody answers
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.close()
