"""The server backend's HTTP client retries a connection the server resets (a full listen backlog, a restart) and
an HTTP 503 (overloaded), with backoff, and gives up with a clear error after its retries. The server here is a
loopback socket that resets its first connections (SO_LINGER 0: an RST, as an overflowing backlog sends) and then
answers: the client is what is under test."""

import json
import socket
import struct
import threading

import pytest

from jaxrl.backends.openai_client import ServerError, http_json


class FlakyServer:
    """Resets the first `resets` connections, answers 503 to the next `busy`, then 200 with a JSON body."""

    def __init__(self, resets: int, busy: int = 0):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.plan = ["reset"] * resets + ["busy"] * busy
        self.seen = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                action = self.plan[self.seen] if self.seen < len(self.plan) else "ok"
                self.seen += 1
                conn.recv(65536)
                if action == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue
                status, body = ("503 Service Unavailable", {"error": {"message": "busy"}}) if action == "busy" else (
                    "200 OK", {"choices": [{"text": "ok"}]})
                data = json.dumps(body).encode()
                conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                             f"Connection: close\r\n\r\n".encode() + data)

    def close(self):
        self.sock.close()


def test_a_reset_connection_and_a_503_are_retried_with_backoff():
    server = FlakyServer(resets=2, busy=1)
    try:
        status, payload = http_json("POST", server.url + "/v1/completions", {"prompt": [1]}, timeout=10,
                                    retries=5, backoff_s=(0.01, 0.02))
        assert (status, payload["choices"][0]["text"], server.seen) == (200, "ok", 4)
    finally:
        server.close()


def test_without_retries_a_reset_is_a_clear_error_and_retries_run_out():
    server = FlakyServer(resets=3)
    try:
        with pytest.raises(ServerError, match="no server answers at"):
            http_json("POST", server.url + "/v1/completions", {"prompt": [1]}, timeout=10)
        assert server.seen == 1
        with pytest.raises(ServerError, match="no server answers at"):
            http_json("POST", server.url + "/v1/completions", {"prompt": [1]}, timeout=10, retries=1,
                      backoff_s=(0.01,))
        assert server.seen == 3
    finally:
        server.close()
