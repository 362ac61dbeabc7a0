"""The server backend end to end over loopback against a real server process (`python -m launchers.serve`, the
JAX-backed OpenAI-compatible server): token ids, seeds, stop ids, log-probs and adapter switching, and the
rollout / evaluation paths through it, sample for sample what the in-process jax backend draws. Plus the clear
errors of a missing, too old or foreign server and of a missing vLLM environment."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.heavy  # each test starts a real server and compiles a sampler

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"
CAP, N, PROMPT_LEN, BATCH = 24, 4, 192, 4  # every sampler call is one prompt's N samples: one batch shape
REWARD = "test_generation_path:text_reward"


def post(url, path, body):
    from jaxrl.backends.openai_client import http_json
    return http_json("POST", url + path, body, timeout=600)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import jax.numpy as jnp

    from jaxrl.models.adapters import Adapter, write_adapter_checkpoint
    from jaxrl.models.peft import export_peft
    from jaxrl.models import qwen35
    from jaxrl.models.lora import linears
    from jaxrl.models.qwen35.config import tiny
    from jaxrl.data.chat import chat_stop_ids, encode_prompts, load_tokenizer
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    from test_evaluate import numpy_init

    root = tmp_path_factory.mktemp("server")
    problems = [json.loads(line) for line in TASKS.read_text().splitlines()[:4]]
    (root / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    base = str(root / "base")
    cfg = tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    qwen35.save_pretrained(numpy_init(cfg), base, base_dir=None, layout="container")
    build_tiny_tokenizer(base, [m["content"] for p in problems for m in p["messages"]])
    model = qwen35.from_pretrained(base, dtype=jnp.float32)
    tok = load_tokenizer(base)
    lin = dict(linears(model))
    targets = ["layers.0.linear_attn.in_proj_qkv", "layers.0.linear_attn.in_proj_z", "layers.1.self_attn.q_proj",
               "layers.1.mlp.down_proj"]
    adapters = {}
    for k, seed in enumerate((1, 2)):  # same modules, rank and alpha: one compiled graph for both
        rng = np.random.default_rng(seed)
        params = {}
        for m in targets:
            params[m + ".lora.lora_A"] = (0.5 * rng.standard_normal((2, lin[m].in_features))).astype(np.float32)
            params[m + ".lora.lora_B"] = (0.5 * rng.standard_normal((lin[m].out_features, 2))).astype(np.float32)
        adapters[f"a{k + 1}"] = Adapter(params=params, rank=2, alpha=4.0, source=f"adapter {k + 1}")
    peft1 = str(root / "peft_a1")
    export_peft(adapters["a1"], peft1, base)
    workdir = str(root / "run")  # a2 as a trainer checkpoint: the backend exports it and loads it at run time
    write_adapter_checkpoint(workdir, 7, adapters["a2"])
    text_layout = str(root / "peft_text")
    export_peft(adapters["a1"], text_layout, base, layout="text", allow_layout_mismatch=True)

    stop_ids = chat_stop_ids(tok, model.config.eos_token_id)
    prompts = encode_prompts(tok, [p["messages"] for p in problems], False, PROMPT_LEN).ids
    ready = root / "ready"
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launchers.serve", f"--base={base}", "--port=0", f"--ready_file={ready}",
         "--dtype=float32", f"--max_prompt_len={PROMPT_LEN}", f"--prompt_buckets={PROMPT_LEN}",
         f"--batch_size={BATCH}", f"--lora_modules=a1={peft1}", f"--allowed_lora_roots={root}"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"launchers.serve did not start:\n{(root / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.2)
    e = {"root": root, "base": base, "model": model, "tok": tok, "adapters": adapters, "peft1": peft1,
         "workdir": workdir, "text_layout": text_layout, "stop_ids": stop_ids, "prompts": prompts,
         "groups": [1000 + 7 * j for j in range(len(prompts))], "url": ready.read_text().strip(),
         "problems": str(root / "problems.jsonl"), "ids": [p["id"] for p in problems]}
    yield e
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def jax_backend(env, adapter=None):
    from jaxrl.backends import JaxBackend, ModelSpec
    backend = JaxBackend(env["base"], model=env["model"], dtype="float32", batch_size=BATCH,
                         max_prompt_len=PROMPT_LEN, prompt_buckets=(PROMPT_LEN,), stop_ids=env["stop_ids"],
                         pad_id=env["tok"].pad_token_id)
    backend.load(ModelSpec("m", "adapter" if adapter is not None else "base", "x"), adapter)
    return backend


def context(env, **kw):
    """What the tests build backends for (jaxrl.backends.settings.BackendContext)."""
    from jaxrl.backends.settings import BackendContext
    return BackendContext(env["base"], stop_ids=tuple(env["stop_ids"]), max_prompt_len=PROMPT_LEN,
                          max_new_tokens=CAP, **kw)


def server_backend(env):
    from jaxrl.backends.settings import ServerRollout
    return ServerRollout((env["url"],)).build(context(env, out_dir=str(env["root"] / "backend")))


def sampling(**kw):
    from jaxrl.backends import SamplingParams
    return SamplingParams(**{"n": N, "max_new_tokens": CAP, "temperature": 1.0, "seed": 5, **kw})


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.prompt_index, g.sample_index) == (w.prompt_index, w.sample_index)
        assert g.tokens == w.tokens, (g.prompt_index, g.sample_index)
        assert g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)


def test_server_samples_equal_the_jax_backend_for_the_same_keys(env):
    """Base, an adapter served at start-up (--lora_modules) and one loaded at run time from a trainer checkpoint:
    the server's samples are the in-process jax backend's, token for token, and each adapter changes them."""
    from jaxrl.models.peft import read_adapter
    from jaxrl.backends import ModelSpec
    backend = server_backend(env)
    assert backend.description.startswith("jaxrl")
    outs, served_as = {}, {}
    for name, spec, adapter in (
            ("base", ModelSpec("base", "base"), None),
            ("a1", ModelSpec("a1", "adapter", env["peft1"]), env["adapters"]["a1"]),
            ("a2", ModelSpec("step_7", "adapter", env["workdir"]), read_adapter(env["workdir"]))):
        backend.load(spec, adapter)
        assert backend.loaded_digest() == (adapter.digest() if adapter is not None else None)
        got = backend.generate(env["prompts"], env["groups"], sampling())
        assert_same(got, jax_backend(env, adapter).generate(env["prompts"], env["groups"], sampling()))
        outs[name] = [g.tokens for g in got]
        served_as[name] = backend._model
    greedy = sampling(n=3, temperature=0.0, max_new_tokens=8)  # vLLM refuses greedy n > 1: one request, 3 rows
    assert_same(backend.generate(env["prompts"][:2], env["groups"][:2], greedy),
                jax_backend(env, adapter).generate(env["prompts"][:2], env["groups"][:2], greedy))
    assert served_as["a1"] == "a1"  # nothing loaded for a1: the server already listed its folder
    assert served_as["a2"].startswith("step_7-")  # loaded at run time from the PEFT export of the checkpoint
    assert outs["base"] != outs["a1"] != outs["a2"]  # the adapters are not no-ops
    assert any(g.finish_reason == "stop" for g in got) and any(g.finish_reason == "length" for g in got)
    a2_name = backend._ours
    backend.close()  # unloads what it loaded
    assert a2_name not in [m["id"] for m in backend_models(env)]


def backend_models(env):
    from jaxrl.backends.openai_client import http_json
    return http_json("GET", env["url"] + "/v1/models")[1]["data"]


def completion(env, **body):
    status, payload = post(env["url"], "/v1/completions", {
        "prompt": env["prompts"][0], "max_tokens": CAP, "temperature": 1.0, "stop_token_ids": list(env["stop_ids"]),
        "logprobs": 0, "return_token_ids": True, **body})
    assert status == 200, payload
    return payload["choices"]


def test_seeds_same_request_same_tokens_and_samples_keyed_by_their_own_seed(env):
    from jaxrl.generation.sampling import request_seed, split_request_seed
    seed = request_seed(5, env["groups"][0])
    four = completion(env, n=4, seed=seed)
    assert [c["token_ids"] for c in completion(env, n=4, seed=seed)] == [c["token_ids"] for c in four]
    # choice i is the sample of seed + i, as vLLM seeds its child requests: n does not change a sample
    assert [c["token_ids"] for c in completion(env, n=2, seed=seed)] == [c["token_ids"] for c in four[:2]]
    assert completion(env, n=1, seed=request_seed(5, env["groups"][0], 3))[0]["token_ids"] == four[3]["token_ids"]
    assert len({tuple(c["token_ids"]) for c in four}) == 4
    assert completion(env, n=1, seed=request_seed(6, env["groups"][0]))[0]["token_ids"] != four[0]["token_ids"]
    for s, g, i in ((0, 0, 0), (5, 2 ** 32 - 1, 7), (2 ** 19 - 1, 2 ** 32 - 1, 4095), (7, 123456789, 0)):
        assert split_request_seed(request_seed(s, g, i)) == (s, g, i)
        assert 0 <= request_seed(s, g, i) < 2 ** 63  # vLLM's int64 range, never -1 (its "no seed")
    with pytest.raises(ValueError, match="seed"):
        request_seed(2 ** 19, 0)


def test_stop_ids_and_logprobs(env):
    """A stop id ends the completion at its first occurrence (kept, stop_reason names it); log-probs are the
    model's own, teacher-forced."""
    import jax
    import jax.numpy as jnp

    from jaxrl.generation.sampling import request_seed
    seed = request_seed(9, 1)
    free = completion(env, n=4, seed=seed, stop_token_ids=[], ignore_eos=True)
    full = max(free, key=lambda c: len(c["token_ids"]))["token_ids"]
    i = full.index(full[len(full) // 2])  # a token of the completion, at its first occurrence
    stop = full[i]
    choice = [c for c in completion(env, n=4, seed=seed, stop_token_ids=[stop], ignore_eos=True)
              if c["index"] == free.index(max(free, key=lambda c: len(c["token_ids"])))][0]
    assert choice["token_ids"] == full[:i + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == CAP for c in free)

    from jaxrl.models.adapters import detach
    detach(env["model"])  # the base (jax_backend() attaches adapters to the shared model object)
    from flax import nnx
    graphdef, state = nnx.split(env["model"])
    ids = jnp.asarray([env["prompts"][0] + full], jnp.int32)
    logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)  # one compile, not one per eager op
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)[0]
    p = len(env["prompts"][0])
    teacher = [float(logp[p - 1 + k, t]) for k, t in enumerate(full)]
    got = max(free, key=lambda c: len(c["token_ids"]))["logprobs"]["token_logprobs"]
    np.testing.assert_allclose(got, teacher, rtol=0, atol=2e-4)


def test_adapter_switching_and_refusals(env):
    """Load / unload through the endpoints; an unloaded adapter is gone; the server's refusals reach the user."""
    from jaxrl.backends import ModelSpec, ServerError
    status, text = post(env["url"], "/v1/load_lora_adapter", {"lora_name": "x1", "lora_path": env["peft1"]})
    assert status == 200 and "added" in text
    card = next(m for m in backend_models(env) if m["id"] == "x1")
    assert card["adapter_digest"] == env["adapters"]["a1"].digest() and card["parent"] == env["base"]
    a1 = completion(env, model="a1", n=2, seed=3)
    assert [c["token_ids"] for c in completion(env, model="x1", n=2, seed=3)] == [c["token_ids"] for c in a1]
    status, payload = post(env["url"], "/v1/load_lora_adapter", {"lora_name": "x1", "lora_path": env["peft1"]})
    assert status == 400 and "already been loaded" in payload["error"]["message"]
    assert post(env["url"], "/v1/unload_lora_adapter", {"lora_name": "x1"})[0] == 200
    status, payload = post(env["url"], "/v1/completions", {"model": "x1", "prompt": [1, 2, 3]})
    assert status == 404 and "does not exist" in payload["error"]["message"]
    status, payload = post(env["url"], "/v1/load_lora_adapter", {"lora_name": "t", "lora_path": env["text_layout"]})
    assert status == 400 and "text layout" in payload["error"]["message"]

    from jaxrl.models.peft import read_peft_adapter
    backend = server_backend(env)
    with pytest.raises(ServerError, match="rejected adapter 'wrong'.*text layout"):
        backend._load_adapter(ModelSpec("wrong", "adapter", env["text_layout"]),
                              read_peft_adapter(env["text_layout"])[0], env["text_layout"])
    status, payload = post(env["url"], "/v1/completions", {"prompt": [1, 2], "repetition_penalty": 1.5})
    assert status == 400 and "repetition_penalty" in payload["error"]["message"]
    with pytest.raises(ServerError, match="serves .* not"):
        backend.load(ModelSpec("other", "hf", env["peft1"]))


def test_text_prompts_and_chat_for_any_openai_client(env):
    status, payload = post(env["url"], "/v1/completions", {"model": "a1", "prompt": "def add(a, b):",
                                                           "max_tokens": CAP, "seed": 1})
    assert status == 200 and isinstance(payload["choices"][0]["text"], str)
    assert payload["usage"]["completion_tokens"] >= 1
    status, payload = post(env["url"], "/v1/chat/completions", {
        "model": "a1", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": CAP, "seed": 1,
        "return_token_ids": True})
    assert status == 200
    choice = payload["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    tokens = choice["token_ids"]
    assert choice["finish_reason"] == "length" or tokens[-1] in env["stop_ids"]


def test_rollouts_and_evaluation_through_the_server_match_the_jax_backend(env):
    """The same resumable JSONL and sample keys on both backends: identical records, adapter included."""
    from jaxrl.evaluation.runner import EvalConfig, Evaluator, ModelSpec
    from jaxrl.rollout.runner import RolloutConfig, run_rollouts
    common = dict(problems=env["problems"], model=env["base"], num_samples=N, temperature=1.0, max_new_tokens=CAP,
                  max_prompt_len=PROMPT_LEN, prompt_buckets=(PROMPT_LEN,), reward=REWARD, batch_size=BATCH,
                  seed=4, dtype="float32", progress=False, adapter=env["peft1"], save_logprobs=True)
    records = {}
    for backend, kwargs in (("jax", {}), ("server", {"server_url": env["url"]})):
        out = env["root"] / f"rollouts_{backend}.jsonl"
        run_rollouts(RolloutConfig(out=str(out), backend=backend, **kwargs, **common),
                     tokenizer=env["tok"])
        records[backend] = [json.loads(line) for line in out.read_text().splitlines()]
        meta = json.loads((env["root"] / f"rollouts_{backend}.jsonl.meta.json").read_text())
        assert meta["settings"]["backend"] == (None if backend == "jax" else "server")
    assert len(records["server"]) == len(env["ids"]) * N
    for mine, ref in zip(records["server"], records["jax"]):
        np.testing.assert_allclose(mine.pop("logprobs"), ref.pop("logprobs"), rtol=0, atol=1e-5)
        assert mine == ref

    cfg = dict(problems=env["problems"], base=env["base"], models=[ModelSpec("a1", "adapter", env["peft1"])],
               num_samples=N, temperature=1.0, max_new_tokens=CAP, max_prompt_len=PROMPT_LEN,
               prompt_buckets=(PROMPT_LEN,), reward=REWARD, batch_size=BATCH, dtype="float32", seed=4,
               n_resamples=200, progress=False)
    samples = {}
    for backend, kwargs in (("jax", {}), ("server", {"server_url": env["url"]})):
        ev = Evaluator(EvalConfig(out=str(env["root"] / f"eval_{backend}"), backend=backend, **kwargs, **cfg),
                       model=env["model"] if backend == "jax" else None, tokenizer=env["tok"])
        try:
            samples[backend] = {name: ev.sample_model(name) for name in ev.specs}
            assert ev.settings("a1")["backend"] == backend
        finally:
            ev.close()
    for name in ("base", "a1"):
        assert samples["server"][name] == samples["jax"][name], name
    # the rollouts of a1 (seed 4) are the evaluation's a1 samples, completion for completion
    by_key = {(r["problem_id"], r["sample_index"]): r for r in samples["server"]["a1"]}
    assert all(r["completion"] == by_key[(r["problem_id"], r["sample_index"])]["completion"]
               for r in records["server"])


class _VersionServer:
    """A stand-in answering /version like an old vLLM: the backend's version check is what is under test."""

    def __init__(self, version):
        body = json.dumps({"version": version}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


def test_missing_old_or_foreign_servers_and_vllm_environments_fail_clearly(env, tmp_path):
    from jaxrl.backends import ServerError
    from jaxrl.backends.settings import ServerRollout, VLLMLaunchOptions, VLLMRollout
    from jaxrl.backends.vllm_backend import ENV_RECIPE, VLLMServer, free_port
    with pytest.raises(ServerError, match="no server answers at http://127.0.0.1:"):
        ServerRollout((f"http://127.0.0.1:{free_port()}",)).build(context(env))
    old = _VersionServer("0.30.0")
    try:
        with pytest.raises(ServerError, match="vLLM 0.30.0, older than the vLLM 0.33"):
            VLLMRollout((old.url,)).build(context(env))
    finally:
        old.httpd.shutdown()
    with pytest.raises(ServerError, match="is a jaxrl .* server, not vLLM"):
        VLLMRollout((env["url"],)).build(context(env))
    here = context(env, out_dir=str(tmp_path))
    with pytest.raises(ServerError, match="no vLLM environment at") as e:
        VLLMRollout(launch=VLLMLaunchOptions(python=str(tmp_path / "nowhere"))).build(here)
    assert ENV_RECIPE[1] in str(e.value)
    with pytest.raises(ServerError, match="has no vLLM installed"):
        VLLMRollout(launch=VLLMLaunchOptions(python=sys.executable)).build(here)
    # the command a launched server runs: LoRA on, parallelism passed through, the model's generation defaults off
    server = VLLMServer(python=sys.executable, tokenizer=env["base"], seed=3, tensor_parallel_size=2,
                        data_parallel_size=4, extra_args=["--enforce-eager"], check_install=False)
    argv = server.command(env["base"], 192 + CAP, max_lora_rank=2, port=1234)
    text = " ".join(argv)
    for part in (f"-m vllm.entrypoints.cli.main serve {env['base']}", "--port 1234", f"--max-model-len {192 + CAP}",
                 "--seed 3", "--generation-config vllm", "--tensor-parallel-size 2", "--data-parallel-size 4",
                 "--enable-lora --max-lora-rank 8 --max-loras 1", "--api-server-count 1", "--enforce-eager"):
        assert part in text, part
    assert server.shell_command(env["base"], 100).startswith("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True ")
    # a server that dies at start-up: the error carries its log
    dying = VLLMServer(python=sys.executable, check_install=False, log_path=str(tmp_path / "vllm.log"),
                       startup_timeout_s=60)
    with pytest.raises(ServerError, match="(?s)exited with code 1 before it was ready.*No module named 'vllm'"):
        dying.start(env["base"], 100)


def test_rollout_launcher_on_the_server_backend(env, tmp_path):
    """`launchers.rollout --backend=server --server_url=...` writes what the in-process jax backend writes."""
    from jaxrl.rollout.runner import RolloutConfig, run_rollouts
    flags = dict(problems=env["problems"], model=env["base"], num_samples=N, temperature=1.0, max_new_tokens=CAP,
                 max_prompt_len=PROMPT_LEN, reward=REWARD, batch_size=BATCH, seed=2, dtype="float32")
    out = tmp_path / "cli.jsonl"
    argv = [f"--{k}={v}" for k, v in flags.items()] + [f"--prompt_buckets={PROMPT_LEN}", f"--out={out}",
                                                       "--backend=server", f"--server_url={env['url']}",
                                                       "--noprogress"]
    run = lambda args: subprocess.run([sys.executable, "-m", "launchers.rollout", *args], cwd=ROOT,  # noqa: E731
                                      capture_output=True, text=True, timeout=600,
                                      env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    proc = run(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = tmp_path / "jax.jsonl"
    run_rollouts(RolloutConfig(out=str(ref), prompt_buckets=(PROMPT_LEN,), progress=False, **flags),
                 tokenizer=env["tok"])
    assert out.read_text() == ref.read_text()
    proc = run([a for a in argv if not a.startswith("--server_url")] + [f"--out={tmp_path / 'x.jsonl'}"])
    assert proc.returncode != 0 and "--backend=server needs --server_url" in proc.stderr
    # resuming the file with the jax backend is refused: the two backends' samples are never mixed
    proc = run([a for a in argv if not a.startswith(("--backend", "--server_url"))])
    assert proc.returncode == 1 and "backend: 'server' -> None" in proc.stderr, proc.stderr[-2000:]


def parsed(module, *args):
    """The config launchers.rollout / launchers.evaluate (its flags `module`) build from `args`."""
    from absl import flags
    values = flags.FlagValues()
    holders = module.define_flags(values)
    values(["launcher", *args])
    return module.build_config(holders)


def test_the_backend_flags_reach_the_built_backend_and_the_deprecated_json_builds_the_same(env, tmp_path,
                                                                                          monkeypatch):
    """--server_concurrency / --server_request_timeout_s (flags made from ServerOptions) reach the ServerBackend
    that evaluation and rollouts build from the config (backend_spec(cfg).build); --backend_kwargs with the same
    keys gives the same config, hence the same backend, with one warning naming the flags. Settings recorded for a
    resume are the same both ways."""
    from jaxrl.backends import openai_client
    from jaxrl.evaluation import flags as evaluate_flags
    from jaxrl.evaluation.runner import Evaluator
    from jaxrl.rollout import flags as rollout_flags
    from jaxrl.rollout.runner import run_rollouts

    built = []

    class Recorded(openai_client.ServerBackend):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(openai_client, "ServerBackend", Recorded)  # what the specs resolve when they build
    typed = ("--backend=server", f"--server_url={env['url']}", "--server_concurrency=3",
             "--server_request_timeout_s=120")
    legacy = ("--backend=server",
              "--backend_kwargs=" + json.dumps({"url": env["url"], "concurrency": 3, "request_timeout_s": 120}))

    common = (f"--problems={env['problems']}", f"--base={env['base']}", f"--adapters=a1={env['peft1']}",
              "--num_samples=1", f"--max_new_tokens={CAP}", f"--max_prompt_len={PROMPT_LEN}", f"--reward={REWARD}",
              "--dtype=float32")
    cfg = parsed(evaluate_flags, *common, f"--out={tmp_path / 'eval'}", *typed)
    with pytest.warns(FutureWarning, match=f"--backend_kwargs is deprecated: give --server_url={env['url']} "
                                           "--server_concurrency=3 --server_request_timeout_s=120 instead"):
        assert parsed(evaluate_flags, *common, f"--out={tmp_path / 'eval'}", *legacy) == cfg
    ev = Evaluator(cfg, tokenizer=env["tok"])
    try:
        assert ev.backend is built[-1] and ev.backend.url == env["url"]
        assert (ev.backend.concurrency, ev.backend.request_timeout_s) == (3, 120.0)
    finally:
        ev.close()

    common = (f"--problems={env['problems']}", f"--model={env['base']}", "--num_samples=2", f"--max_new_tokens={CAP}",
              f"--max_prompt_len={PROMPT_LEN}", f"--reward={REWARD}", "--seed=2", "--dtype=float32", "--limit=1",
              "--noprogress")
    metas = []
    for args in (typed, legacy):
        out = tmp_path / f"rollouts_{len(metas)}.jsonl"
        with pytest.warns(FutureWarning) if args is legacy else contextlib.nullcontext():
            cfg = parsed(rollout_flags, *common, f"--out={out}", *args)
        run_rollouts(cfg, tokenizer=env["tok"])
        assert isinstance(built[-1], Recorded) and built[-1].url == env["url"]
        assert (built[-1].concurrency, built[-1].request_timeout_s) == (3, 120.0)
        metas.append(json.loads(out.with_name(out.name + ".meta.json").read_text())["settings"])
        assert len(out.read_text().splitlines()) == 2
    assert metas[0]["backend"] == "server" and metas[0] == metas[1]  # the same settings: each resumes the other
