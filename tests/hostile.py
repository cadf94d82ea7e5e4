"""Hostile peers for the tests and benchmarks/trickle.py: what a slow or malicious upstream does."""

from __future__ import annotations

import socket
import threading


class Trickler:
    """A hostile teacher: it accepts, reads the request, then sends its response head one byte every ``gap``
    seconds (a per-read timeout never fires: each read gets a byte in time)."""

    HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    def __init__(self, gap: float):
        self.gap, self.accepted, self._stop = gap, 0, threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self.accepted += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn):
        conn.settimeout(1.0)
        try:
            conn.recv(1 << 16)
            for byte in self.HEAD:
                if self._stop.wait(self.gap):
                    break
                conn.sendall(bytes([byte]))
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self._stop.set()
        self._listener.close()
