"""The probes of issue 41 against a real `launchers.serve` process over loopback, as a careless or hostile client
would send them, with the numbers they produced before the fix (main 14e6c06, in the issue) beside today's.

    python -m benchmarks.bench_server_abuse            # a tiny random model, float32, default server limits

  * abandoned: a client sends n=256, max_tokens=1000 and disconnects after 2 s: rows decoded to the end in the 15 s
    after (`rows_generated_total`; before: 256), rows cancelled, and a 1000-token request's latency alone and right
    after the abandoned one (before: 1.7 s alone, 16.5-19.8 s behind the abandoned rows);
  * frozen: the slowest `/health` answer while the server takes sixteen 1.9 MB stop strings (before: 31.8 s) and
    echo + logprobs=20 + n=256 + max_tokens=1000 (before: 58 s), with the status each request got;
  * shutdown: SIGTERM with --graceful_shutdown_s=5 and a request that needs longer in flight: its status and error
    type (before: a plain-text 500), and whether a request on a kept-alive connection after the signal is refused.

Numbers move with the machine's load (recorded); the counts (rows, statuses) do not.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

LONG = {"prompt": "The quick brown fox", "n": 256, "max_tokens": 1000, "temperature": 1.0, "seed": 3,
        "ignore_eos": True}


def request(url: str, method: str, path: str, body=None, timeout=600):
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=timeout)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def metrics(url: str) -> dict:
    text = request(url, "GET", "/metrics")[1].decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


def timed(url: str, body) -> float:
    t0 = time.perf_counter()
    status, _ = request(url, "POST", "/v1/completions", body)
    assert status == 200, status
    return time.perf_counter() - t0


def abandoned(url: str) -> dict:
    one = {**LONG, "n": 1}
    alone = timed(url, one)
    data = json.dumps(LONG).encode()
    host, port = url.split("//")[1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    time.sleep(2.0)
    before = metrics(url)
    sock.close()
    behind = timed(url, one)
    time.sleep(max(0.0, 15.0 - behind))
    after = metrics(url)
    return {"rows_decoded_to_the_end_in_15_s": after["jaxrl:rows_generated_total"] - before[
        "jaxrl:rows_generated_total"] - 1, "rows_cancelled": after["jaxrl:rows_cancelled_total"] - before[
        "jaxrl:rows_cancelled_total"], "request_alone_s": round(alone, 2), "request_behind_abandoned_s": round(
        behind, 2), "before_fix": {"rows_decoded_to_the_end": 256, "request_alone_s": 1.7,
                                   "request_behind_abandoned_s": [16.5, 19.8]}}


def slowest_health(url: str, body) -> tuple[int, float]:
    worst, stop = [0.0], threading.Event()

    def probe():
        while not stop.is_set():
            t0 = time.perf_counter()
            request(url, "GET", "/health")
            worst[0] = max(worst[0], time.perf_counter() - t0)
            time.sleep(0.01)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    status, _ = request(url, "POST", "/v1/completions", body)
    stop.set()
    thread.join()
    return status, round(worst[0] * 1000, 1)


def frozen(url: str) -> dict:
    stops = {"prompt": "x", "max_tokens": 4, "stop": ["y" * 1_900_000] * 16}
    big = {**LONG, "echo": True, "logprobs": 20}
    s1, h1 = slowest_health(url, stops)
    s2, h2 = slowest_health(url, big)
    return {"huge_stop_strings": {"status": s1, "slowest_health_ms": h1, "before_fix_health_ms": 31800},
            "echo_logprobs_20_n256_1000_tokens": {"status": s2, "slowest_health_ms": h2,
                                                  "before_fix_health_ms": 58000}}


def shutdown(root: str, base: str) -> dict:
    from serve_fixture import Served
    server = Served(root, base, "--max_model_len=1100", "--graceful_shutdown_s=5", name="shutdown")
    try:
        timed(server.url, {**LONG, "n": 1, "max_tokens": 4})
        result = {}
        thread = threading.Thread(target=lambda: result.update(
            zip(("status", "body"), request(server.url, "POST", "/v1/completions", LONG))))
        thread.start()
        time.sleep(2.0)
        kept = http.client.HTTPConnection(server.url.split("//")[1], timeout=60)
        kept.request("GET", "/health")
        kept.getresponse().read()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:
            kept.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 2}),
                         headers={"Content-Type": "application/json"})
            after = kept.getresponse().status
        except (OSError, http.client.HTTPException) as e:
            after = type(e).__name__
        thread.join(120)
        body = json.loads(result["body"]) if result.get("status") == 503 else result.get("body", b"")[:200]
        code = server.stop(signal.SIGTERM)
        log = server.output()
        return {"in_flight_status": result.get("status"), "in_flight_error_type":
                body.get("error", {}).get("type") if isinstance(body, dict) else str(body),
                "request_after_signal": after, "exit_status": code, "traceback_in_log": "Traceback" in log,
                "before_fix": "plain-text 500 (InvalidStateError: CANCELLED traceback); a request after the signal "
                              "accepted"}
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def main() -> None:
    from serve_fixture import Served, build_base
    root = tempfile.mkdtemp(prefix="bench_server_abuse_")
    load_before = [round(x, 2) for x in os.getloadavg()]
    base = build_base(os.path.join(root, "base"), max_positions=1100)
    server = Served(root, base, "--max_model_len=1100")
    try:
        timed(server.url, {**LONG, "n": 8, "max_tokens": 1000})  # compiled before anything is timed
        out = {"abandoned": abandoned(server.url), "frozen": frozen(server.url)}
    finally:
        server.stop(signal.SIGKILL)
    out["shutdown"] = shutdown(root, base)
    out["load_average_before"], out["load_average_after"] = load_before, [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
