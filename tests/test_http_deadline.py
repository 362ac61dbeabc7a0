"""A request's timeout bounds the whole request (jaxrl.backends.openai_client.http_json, shared by the rollout
servers' and the teachers' clients), and its message names the setting of the client that sent it."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from jaxrl.backends.openai_client import ServerError, http_json


def _drip_server(body_only: bool):
    """A server that answers one byte every 0.3 s for ever: the status line and headers too (body_only=False), or a
    prompt header with a long Content-Length, then the body's bytes (body_only=True)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    def drip(conn):
        try:
            conn.recv(65536)
            if body_only:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
            payload = b"HTTP/1.1 200 OK\r\n" if not body_only else b" " * 100000
            for i in range(10 ** 6):
                if stop.is_set():
                    return
                conn.sendall(payload[i % len(payload):i % len(payload) + 1])
                time.sleep(0.3)
        except OSError:
            pass
        finally:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", lambda: (stop.set(), listener.close())


@pytest.mark.parametrize("body_only", [False, True])
def test_a_server_dripping_one_byte_at_a_time_cannot_hold_a_request(body_only):
    """Reproduction (2e1e1a6): a server sending one byte every 2 s never timed out (`request_timeout_s` bounded each
    socket read, not the request). Now the request fails at its deadline, naming the server and the setting."""
    url, close = _drip_server(body_only)
    outcome = {}

    def call():
        try:
            http_json("POST", url + "/v1/completions", {"prompt": [1]}, timeout=1.5)
        except ServerError as e:
            outcome["error"] = str(e)

    try:
        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(30)  # a bound on a hang, not a measurement: the deadline is 1.5 s
        assert not worker.is_alive(), "the request outlived its deadline"
    finally:
        close()
    assert "did not answer within 1.5 s" in outcome["error"] and url in outcome["error"]
    assert "rollout_server.request_timeout_s" in outcome["error"]


def test_a_teachers_timeout_names_the_teachers_setting():
    """Reproduction (2e1e1a6): the teacher's timeout named `rollout_server.request_timeout_s`; it is
    `distill.teacher_server.request_timeout_s`."""
    from jaxrl.backends.teacher_client import ServerTeacher
    url, close = _drip_server(body_only=True)
    teacher = ServerTeacher.__new__(ServerTeacher)  # without its probe: the request is what is tested
    teacher.k, teacher.width, teacher.vocab_size, teacher.timeout_s = 2, 4, 0, 1.5
    try:
        with pytest.raises(ServerError, match=r"within 1.5 s .*distill.teacher_server.request_timeout_s"):
            teacher._post(url, "teacher", [1, 2, 3])
    finally:
        close()
