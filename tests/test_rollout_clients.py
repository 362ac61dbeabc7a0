"""Rollout clients facing servers that stop answering or answer garbage (issue 41, point 4 and the client side of
point 7): a per-request timeout sized from max_tokens; a training run whose rollout server hangs (a real
`launchers.serve` process frozen with SIGSTOP) logs a progress line per server while it waits, honours the first
SIGINT (the last finished step checkpointed, exit 130, the partial rollout dropped) and resumes from there; a
truncated JSON answer is a one-line error naming the server, not an AttributeError."""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serve_fixture import Served, build_base

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_the_request_timeout_is_sized_from_max_tokens():
    from jaxrl.backends.openai_client import request_timeout
    from jaxrl.backends.settings import ServerOptions
    assert ServerOptions.request_timeout_s == 0.0  # sized by default, not a flat hour
    assert request_timeout(16) == pytest.approx(61.6) and request_timeout(4096) == pytest.approx(469.6)
    assert request_timeout(4096, 5.0) == 5.0  # a configured value wins


class _Garbled(http.server.BaseHTTPRequestHandler):
    """A server that speaks the API's metadata and answers completions with a truncated JSON body."""

    def _send(self, text: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/version":
            self._send(json.dumps({"version": "0.1.0", "server": "jaxrl"}))
        else:
            self._send(json.dumps({"data": [{"id": "base", "root": "/nowhere"}]}))

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send('{"id": "cmpl-1", "choices": [{"index": 0, "text": "hel')

    def log_message(self, *args):
        pass


def test_a_truncated_json_answer_is_a_one_line_error_naming_the_server(tmp_path):
    from jaxrl.backends.base import SamplingParams
    from jaxrl.backends.openai_client import ServerBackend, ServerError
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbled)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        backend = ServerBackend(str(tmp_path), url=url)
        backend._model = "base"  # what load() sets once it checked the served base (this server serves none)
        with pytest.raises(ServerError) as e:
            backend.generate([[1, 2, 3]], [0], SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
        message = str(e.value)
        assert url in message and "not a completion" in message and "\n" not in message, message
    finally:
        httpd.shutdown()


def test_a_frozen_server_times_out_naming_it(tmp_path):
    from jaxrl.backends.base import SamplingParams
    from jaxrl.backends.openai_client import ServerBackend, ServerError
    server = Served(tmp_path, build_base(tmp_path / "base"), "--batch_size=8", "--max_prompt_len=32",
                    "--prompt_buckets=32", "--max_model_len=64")
    try:
        backend = ServerBackend(str(tmp_path / "base"), url=server.url, request_timeout_s=1.0)
        backend._model = backend._base_name
        server.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(ServerError) as e:  # the 1 s timeout, named, not the sized default's 60.4 s
            backend.generate([[1, 2, 3]], [0], SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
        assert server.url in str(e.value) and "did not answer within 1 s" in str(e.value), str(e.value)
    finally:
        server.proc.send_signal(signal.SIGCONT)
        server.stop(signal.SIGKILL)


KEEP_ALL = """from configs import grpo_tiny


def get_config():
    c = grpo_tiny.get_config()
    c.keep_checkpoints = None
    return c
"""


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_a_hung_rollout_server_shows_progress_and_the_first_sigint_keeps_the_last_step(tmp_path):
    from launcher_env import launch_env

    from jaxrl.train.metrics import read_metrics
    base = build_base(tmp_path / "base")
    server = Served(tmp_path, base, f"--allowed_lora_roots={tmp_path}", "--max_prompt_len=32", "--prompt_buckets=32",
                    "--batch_size=8", "--max_model_len=128")
    config = tmp_path / "grpo_keep_all.py"
    config.write_text(KEEP_ALL)
    workdir = tmp_path / "run"
    log_path = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "launchers.train", f"--config={config}", f"--workdir={workdir}",
           f"--config.model_path={base}", "--config.steps=20", "--config.checkpoint_every=100",
           "--config.tensorboard=False", "--config.checkpoint_async=False", "--config.grpo.rollout_batch_size=8",
           "--config.grpo.rollout_backend=server", f"--config.grpo.rollout_servers=('{server.url}',)",
           "--config.grpo.rollout_server.progress_every_s=1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(tmp_path / "jax_cache"), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (workdir / "metrics.jsonl").exists() or not read_metrics(str(workdir)):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        server.proc.send_signal(signal.SIGSTOP)  # hung from here on: accepts connections, answers nothing
        before = len(log_path.read_text())  # progress lines of the first rollout (the server compiling) came earlier
        while "rows answered" not in log_path.read_text()[before:]:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, log_path.read_text()[-3000:]
        done = read_metrics(str(workdir))[-1]["step"]
        out = log_path.read_text()
        assert f"{server.url} 0/" in out, out[-3000:]  # the progress line names the server that does not answer
        assert "stopped while waiting for the servers" in out and f"training stopped after step {done}" in out, \
            out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert os.path.isdir(workdir / "checkpoints" / "state" / str(done)), sorted(os.listdir(workdir / "checkpoints"))
    finally:
        if proc.poll() is None:
            proc.kill()
        server.proc.send_signal(signal.SIGCONT)
        server.stop(signal.SIGKILL)
