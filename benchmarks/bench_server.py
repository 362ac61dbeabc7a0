"""Requests/s and tokens/s of `launchers.serve` (FastAPI + uvicorn, jaxrl/serve/app.py, the generation engine's
continuous batching: `new`) against the FastAPI server on the static-batch engine it replaced (`static`:
BatchingEngine) and against the server before FastAPI (`old`: the standard library's ThreadingHTTPServer), on one
concurrent load.

The two earlier servers come from git history: `static` is jaxrl/rollout/server.py at STATIC_COMMIT (its
`engine="static"`), whose whole `jaxrl/` is imported next to this tree's as `jaxrl_static`
(`benchmarks.bench_rollout_engine.static_package`); `old` is jaxrl/rollout/server.py at OLD_SERVER_COMMIT, one file
run on that same package (its imports renamed): on STATIC_COMMIT's static sampler, the modules this benchmark ran
it on until they left the tree.

The servers run in this process on the same weights (the small Qwen3.5 of benchmarks/common.py, fp32: one model
object of this tree's jaxrl for `new`, one of `jaxrl_static` for the other two) with the same settings (32 rows at
once: the continuous engine's slots, the static engines' batch; one prompt bucket; the static engines gather a
batch for 5 ms); the load comes from a separate client process: `concurrency` threads, each with its own
keep-alive connection, send `requests` POST /v1/completions in total (token-id prompts of `prompt_len`,
temperature 1, a seed per request as the server backend sends them, so that every server samples the same rows;
`max_tokens` each, or with `max_tokens_min` request i asks for a value spread over [max_tokens_min, max_tokens]).
Each server first takes the whole load once untimed, in turns, until a pass compiles nothing, then `repeats` times
timed, in turns (a side's figures: its median pass by wall time; on a shared machine the load moves between
passes, and turns spread that over the sides). A connection the old server drops (its listen backlog is 5) is
reopened and the request sent again; the count is reported. The load average (1 minute) is read before and after.

    python -m benchmarks.bench_server [--requests 256] [--concurrency 32] [--max_tokens 64] [--max_tokens_min 1]
                                      [--sides old,static,new] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_SERVER_COMMIT = "2177a93"  # the last commit with the ThreadingHTTPServer server (jaxrl/rollout/server.py)
# the last commit with the static-batch serve engine (jaxrl/rollout/serve_engine.py) and the static sampler
STATIC_COMMIT = "c7219bb"


# ------------------------------------------------------------------------------------------------ the client


def _max_tokens(i: int, max_tokens: int, max_tokens_min: int) -> int:
    """Request i's max_tokens: all the same, or spread over [max_tokens_min, max_tokens] (a fixed permutation)."""
    if not max_tokens_min:
        return max_tokens
    return max_tokens_min + (i * 37) % (max_tokens - max_tokens_min + 1)


def _client(url: str, requests: int, concurrency: int, prompt_len: int, max_tokens: int,
            max_tokens_min: int = 0) -> dict:
    """Runs the load against `url` (in the client process); returns counts and the wall time."""
    from jaxrl.generation.sampling import request_seed

    host = url.split("//")[1]
    local = threading.local()
    reconnects = [0]

    def post(body: bytes):
        for attempt in range(6):
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = http.client.HTTPConnection(host, timeout=600)
            try:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                return resp.status, json.loads(resp.read())
            except (ConnectionError, http.client.HTTPException, OSError):
                conn.close()
                local.conn = None
                reconnects[0] += 1
                time.sleep(0.1 * (attempt + 1))
        raise RuntimeError(f"{url}: a request failed 6 times")

    def one(i: int):
        prompt = [5 + (i * 7 + k * 13) % 240 for k in range(prompt_len)]
        body = json.dumps({"prompt": prompt, "max_tokens": _max_tokens(i, max_tokens, max_tokens_min),
                           "temperature": 1.0,
                           "seed": request_seed(0, i), "logprobs": 0}).encode()
        status, payload = post(body)
        if status != 200:
            raise RuntimeError(f"{url}: HTTP {status}: {payload}")
        return payload["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "requests": requests, "completion_tokens": int(sum(tokens)), "reconnects": reconnects[0]}


def _load(url: str, **load) -> dict:
    """The load of `_client`, from a separate process (the client's threads do not share this process's GIL)."""
    code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); from benchmarks.bench_server import _client; "
            f"print(json.dumps(_client({url!r}, **{load!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"the load client failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ the servers


def _static_package():
    """jaxrl/ at STATIC_COMMIT, imported as `jaxrl_static` (benchmarks/bench_rollout_engine.py's static side)."""
    from benchmarks import bench_rollout_engine
    assert bench_rollout_engine.STATIC_COMMIT == STATIC_COMMIT
    return bench_rollout_engine.static_package()


def _old_server_module(folder: str):
    """jaxrl/rollout/server.py at OLD_SERVER_COMMIT, imported from `folder` as `jaxrl_old_server`, its `jaxrl`
    imports renamed to the STATIC_COMMIT package (the modules it was written against have left this tree)."""
    from benchmarks.versus import rename_imports
    source = subprocess.run(["git", "-C", ROOT, "show", f"{OLD_SERVER_COMMIT}:jaxrl/rollout/server.py"],
                            capture_output=True, text=True, check=True).stdout
    path = os.path.join(folder, "jaxrl_old_server.py")
    with open(path, "w") as f:
        f.write(rename_imports(source, _static_package().__name__))
    spec = importlib.util.spec_from_file_location("jaxrl_old_server", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _old_server(module, base: str, model, tok, settings: dict):
    server = module.CompletionServer(base, model=model, tokenizer=tok, max_prompt_len=settings["prompt_bucket"],
                                     batch_size=settings["batch_size"], prompt_buckets=(settings["prompt_bucket"],),
                                     batch_wait_s=settings["batch_wait_s"])
    httpd = server.serve("127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.url
    finally:
        server.close()
        thread.join(60)


@contextlib.contextmanager
def _static_server(base: str, model, tok, settings: dict):
    """STATIC_COMMIT's FastAPI server on its static-batch engine (BatchingEngine)."""
    server_module = importlib.import_module(f"{_static_package().__name__}.rollout.server")
    server = server_module.CompletionServer(
        base, model=model, tokenizer=tok, batch_size=settings["batch_size"],
        limits=server_module.ServeLimits(max_prompt_len=settings["prompt_bucket"]),
        prompt_buckets=(settings["prompt_bucket"],), batch_wait_s=settings["batch_wait_s"], engine="static")
    handle = server_module.ServerThread(server)
    try:
        yield handle.url
    finally:
        handle.stop()


@contextlib.contextmanager
def _new_server(base: str, model, tok, settings: dict):
    from jaxrl.serve.app import CompletionServer, ServerThread
    from jaxrl.serve.settings import ServeLimits
    server = CompletionServer(base, model=model, tokenizer=tok, batch_size=settings["batch_size"],
                              limits=ServeLimits(max_prompt_len=settings["prompt_bucket"]),
                              prompt_buckets=(settings["prompt_bucket"],))
    handle = ServerThread(server)
    try:
        yield handle.url
    finally:
        handle.stop()


def _base_folder(folder: str) -> str:
    from benchmarks.common import save_small_hf
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    save_small_hf(folder, seed=0)
    build_tiny_tokenizer(folder, ["def add(a, b):\n    return a + b\n", "hello world"])
    return folder


def run(requests: int = 256, concurrency: int = 32, prompt_len: int = 48, max_tokens: int = 64,
        batch_size: int = 32, max_tokens_min: int = 0, sides: tuple = ("old", "static", "new"),
        repeats: int = 1) -> dict:
    """Measure and return the numbers of the servers `sides` (module docstring); prints nothing."""
    import jax.numpy as jnp

    from jaxrl.data.chat import load_tokenizer
    from jaxrl.generation.programs import TRACE_COUNTS
    from jaxrl.models import qwen35

    settings = {"batch_size": batch_size, "prompt_bucket": 64, "batch_wait_s": 0.005}
    # every program traced so far, by this tree's engine and (old, static) by STATIC_COMMIT's sampler
    counters = [TRACE_COUNTS]
    if {"old", "static"} & set(sides):
        counters.append(importlib.import_module(f"{_static_package().__name__}.rollout.sampler").TRACE_COUNTS)

    def traced() -> int:
        return sum(len(c) for c in counters)

    load = {"requests": requests, "concurrency": concurrency, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "max_tokens_min": max_tokens_min}
    load_average = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        base = _base_folder(os.path.join(tmp, "base"))
        model = qwen35.from_pretrained(base, dtype=jnp.float32)
        tok = load_tokenizer(base)
        with contextlib.ExitStack() as stack:
            urls = {}
            if {"old", "static"} & set(sides):  # STATIC_COMMIT's servers take a model of their own package
                static_model = _static_package().models.qwen35.from_pretrained(base, dtype=jnp.float32)
            for side in sides:
                if side == "old":
                    urls[side] = stack.enter_context(_old_server(_old_server_module(tmp), base, static_model, tok,
                                                                 settings))
                elif side == "static":
                    urls[side] = stack.enter_context(_static_server(base, static_model, tok, settings))
                elif side == "new":
                    urls[side] = stack.enter_context(_new_server(base, model, tok, settings))
                else:
                    raise ValueError(f"sides: unknown {side!r} (old, static, new)")
            # untimed passes until a pass compiles nothing (servers of one engine share its programs by shape)
            warm = {name: [] for name in urls}
            for _ in range(6):
                before = traced()
                for name, url in urls.items():
                    warm[name].append(_load(url, **load)["wall_s"])
                if traced() == before:
                    break
            passes = {name: [] for name in urls}
            compiled = {name: 0 for name in urls}
            for _ in range(repeats):
                for name, url in urls.items():
                    before = traced()
                    passes[name].append(_load(url, **load))
                    compiled[name] += traced() - before
            measured = {}
            for name, timed in passes.items():
                median = sorted(timed, key=lambda t: t["wall_s"])[len(timed) // 2]
                measured[name] = {**median, "timed_wall_s": [t["wall_s"] for t in timed],
                                  "warmup_wall_s": warm[name], "compiled_while_timed": compiled[name],
                                  "requests_per_s": median["requests"] / median["wall_s"],
                                  "tokens_per_s": median["completion_tokens"] / median["wall_s"]}
    load_average.append(os.getloadavg()[0])
    out = {"load": load, "settings": settings, "old_server_commit": OLD_SERVER_COMMIT, "static_commit": STATIC_COMMIT,
           "load_average": load_average, **measured}
    for name, (a, b) in {"": ("new", "old"), "_continuous_vs_static": ("new", "static"),
                         "_static_vs_old": ("static", "old")}.items():
        if a in measured and b in measured:
            for what in ("requests_per_s", "tokens_per_s"):
                out[f"ratio{name}_{what}"] = measured[a][what] / measured[b][what]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt_len", type=int, default=48)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--max_tokens_min", type=int, default=0, help="0: every request at --max_tokens")
    parser.add_argument("--sides", default="old,static,new", help="servers to measure: old, static, new")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes per server, in turns")
    args = parser.parse_args()
    result = run(args.requests, args.concurrency, args.prompt_len, args.max_tokens,
                 max_tokens_min=args.max_tokens_min, sides=tuple(args.sides.split(",")), repeats=args.repeats)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
