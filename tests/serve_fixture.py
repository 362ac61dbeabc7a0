"""A served tiny model for the server tests: a real `python -m launchers.serve` process over loopback.

    base = build_base(tmp_path / "base")                 # tiny Qwen3.5 folder + tokenizer (any printable ASCII)
    server = Served(tmp_path, base, "--max_model_len=512")
    server.url, server.proc; server.stop() -> exit status
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ["def add(a, b):\n    return a + b\n", "The capital of France is Paris.", "Question: 2 + 2 = ?\nAnswer: 4",
          "Say hi", "hello world", "The quick brown fox jumps over the lazy dog."]


def build_base(folder, max_positions: int = 512, layers: int = 2, seed: int = 0) -> str:
    """A random tiny base model folder (container layout) with the tiny tokenizer; returns its path."""
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.config import tiny
    from test_evaluate import numpy_init

    folder = str(folder)
    cfg = tiny(num_hidden_layers=layers, layer_types=("linear_attention", "full_attention")[:layers],
               max_position_embeddings=max_positions)
    qwen35.save_pretrained(numpy_init(cfg, seed), folder, base_dir=None, layout="container")
    build_tiny_tokenizer(folder, CORPUS * 4)
    return folder


class Served:
    """`launchers.serve` on a free loopback port; waits for its ready file."""

    def __init__(self, root, base: str, *flags: str, name: str = "serve", timeout_s: float = 300, port: int = 0,
                 warmup: bool = False):
        """port: 0 = a free one; a given port restarts a stopped server where its clients expect it. warmup: compile
        every bucket's programs before listening (launchers.serve's default; off here so a test server starts in
        seconds: each shape compiles at its first request instead, tests/test_serve_warmup.py proves the warm-up)."""
        root = Path(root)
        self.ready = root / f"{name}.ready"
        self.ready.unlink(missing_ok=True)
        self.log_path = root / f"{name}.log"
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launchers.serve", f"--base={base}", f"--port={port}", f"--ready_file={self.ready}",
             "--dtype=float32", f"--warmup={str(warmup).lower()}", *flags],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"launchers.serve did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        self.url = self.ready.read_text().strip()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
