"""`launchers.serve` as the field's clients see it, over loopback against a real server process: the official
`openai` SDK (streaming completions and chat, log-probs with top-k, echo at max_tokens=0, stop strings, errors in
the OpenAI shape), lm-evaluation-harness (`local-completions` for a multiple-choice and a generate_until task,
`local-chat-completions`), and the failures the server used to have as a service (a max_tokens of 1e8, 200
concurrent requests, many distinct max_tokens, malformed bodies and lengths, runtime adapter paths, signals, an
evaluation at the server backend's default concurrency)."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from serve_fixture import ROOT, Served, build_base

pytestmark = pytest.mark.slow  # a served model: a server process and its compilations

MAX_LEN, PROMPT_LEN = 512, 256
FLAGS = (f"--max_prompt_len={PROMPT_LEN}", "--prompt_buckets=64,256", "--generation_buckets=16,64",
         "--batch_size=8")
TEXT = "The quick brown fox jumps over the lazy dog."
# Server log-probs against the trainer's teacher-forced pass of the same tokens, fp32:
SCORED_ATOL = 1e-5  # echo / top-k: the same hidden_states + token_logprobs, only the padding differs
SAMPLED_ATOL = 2e-4  # logprobs=0: the sampler's decode path (recurrent GDN state, KV cache) vs the chunked pass


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import jax.numpy as jnp

    from jaxrl.data.chat import load_tokenizer
    from jaxrl.models.peft import export_peft
    from jaxrl.models import qwen35
    from jaxrl.models.adapters import Adapter
    from jaxrl.models.lora import linears

    root = tmp_path_factory.mktemp("serve_api")
    base = build_base(root / "base", max_positions=MAX_LEN)
    model = qwen35.from_pretrained(base, dtype=jnp.float32)
    lin = dict(linears(model))
    rng = np.random.default_rng(3)
    params = {}
    for m in ("layers.1.self_attn.q_proj", "layers.1.mlp.down_proj"):
        params[m + ".lora.lora_A"] = (0.5 * rng.standard_normal((2, lin[m].in_features))).astype(np.float32)
        params[m + ".lora.lora_B"] = (0.5 * rng.standard_normal((lin[m].out_features, 2))).astype(np.float32)
    adapters = root / "adapters"
    export_peft(Adapter(params=params, rank=2, alpha=4.0, source="test"), str(adapters / "a1"), base)
    (adapters / "empty").mkdir()
    server = Served(root, base, *FLAGS, f"--allowed_lora_roots={adapters}")
    yield {"root": root, "base": base, "url": server.url, "server": server, "model": model,
           "tok": load_tokenizer(base), "adapters": adapters}
    server.stop()


def client(env):
    import openai
    return openai.OpenAI(base_url=env["url"] + "/v1", api_key="none", max_retries=0)


def post(env, path, body, raw=None, headers=None):
    """(status, parsed body) of one POST; `raw` bytes are sent as they are."""
    conn = http.client.HTTPConnection(env["url"].split("//")[1], timeout=300)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(text)
    except json.JSONDecodeError:
        return resp.status, text


def assert_error(status, payload, code, *words):
    assert status == code, (status, payload)
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    for w in words:
        assert w in err["message"], (w, err["message"])


def teacher_forced(env, ids):
    """log p(ids[t] | ids[:t]) for t >= 1 and the full log-softmax rows, by the trainer's pass (hidden_states +
    token_logprobs, as jaxrl.train.objective.NextToken), fp32."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models.adapters import detach
    from jaxrl.ops.logprobs import token_logprobs

    detach(env["model"])
    graphdef, state = nnx.split(env["model"])

    @jax.jit
    def run(state, x):
        model = nnx.merge(graphdef, state)
        hidden, _ = model.hidden_states(x, jnp.ones_like(x))
        logp = token_logprobs(hidden[:, :-1], model.head_weight(), x[:, 1:])
        return logp, jax.nn.log_softmax(model.logits_from_hidden(hidden[:, :-1]).astype(jnp.float32), axis=-1)

    logp, full = run(state, jnp.asarray([ids], jnp.int32))
    return np.asarray(logp[0]), np.asarray(full[0])


# ------------------------------------------------------------------------------------------------ the openai SDK


def test_streaming_completions_and_chat_match_the_plain_responses(env):
    c = client(env)
    kwargs = dict(model=env["base"], prompt=TEXT, max_tokens=12, temperature=1.0, seed=7)
    plain = c.completions.create(**kwargs)
    chunks = list(c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == plain.choices[0].text and len(plain.choices[0].text) > 0
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens
    assert plain.usage.completion_tokens == 12 and plain.usage.prompt_tokens > 0

    messages = [{"role": "user", "content": "Say hi"}]
    chat = c.chat.completions.create(model=env["base"], messages=messages, max_tokens=10, seed=3)
    stream = list(c.chat.completions.create(model=env["base"], messages=messages, max_tokens=10, seed=3,
                                            stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == chat.choices[0].message.content
    assert stream[-1].usage.completion_tokens == chat.usage.completion_tokens
    # the raw stream ends with [DONE]
    conn = http.client.HTTPConnection(env["url"].split("//")[1], timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({**kwargs, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.getheader("content-type").startswith("text/event-stream")
    assert resp.read().decode().rstrip().endswith("data: [DONE]")


def test_echo_at_max_tokens_zero_and_top_logprobs_equal_the_trainers_teacher_forced_pass(env):
    c = client(env)
    # token ids as the keys of the top-k dicts: two ids of one text would share a key (vLLM's remedy too)
    out = c.completions.create(model=env["base"], prompt=TEXT, max_tokens=0, echo=True, logprobs=3,
                               extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = out.choices[0]
    ids = choice.to_dict()["prompt_token_ids"]
    assert choice.text == TEXT and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref, full = teacher_forced(env, ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], ref, rtol=0, atol=SCORED_ATOL)
    for t, top in enumerate(lp.top_logprobs[1:]):
        best = np.argsort(-full[t], kind="stable")[:3]  # the 3 most likely, and the prompt token itself
        want = {f"token_id:{i}": full[t, i] for i in [*best, ids[t + 1]]}
        assert set(top) == set(want)
        np.testing.assert_allclose([top[k] for k in want], list(want.values()), rtol=0, atol=SCORED_ATOL)

    # sampled tokens: logprobs=0 gives the sampler's own log-prob, logprobs=2 the teacher-forced one + the top 2
    gen = dict(model=env["base"], prompt=ids, max_tokens=10, temperature=1.0, seed=11,
               extra_body={"return_token_ids": True, "ignore_eos": True})
    zero = c.completions.create(**gen, logprobs=0).choices[0]
    two = c.completions.create(**gen, logprobs=2).choices[0]
    tokens = zero.to_dict()["token_ids"]
    assert two.to_dict()["token_ids"] == tokens and len(tokens) == 10
    ref, full = teacher_forced(env, ids + tokens)
    np.testing.assert_allclose(zero.logprobs.token_logprobs, ref[len(ids) - 1:], rtol=0, atol=SAMPLED_ATOL)
    np.testing.assert_allclose(two.logprobs.token_logprobs, ref[len(ids) - 1:], rtol=0, atol=SCORED_ATOL)
    for k, top in enumerate(two.logprobs.top_logprobs):
        assert max(top.values()) == pytest.approx(full[len(ids) - 1 + k].max(), abs=SCORED_ATOL)

    chat = c.chat.completions.create(model=env["base"], messages=[{"role": "user", "content": "Say hi"}],
                                     max_tokens=6, seed=2, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + SCORED_ATOL


def test_stop_strings_are_matched_on_the_text_and_left_out(env):
    c = client(env)
    kwargs = dict(model=env["base"], prompt=TEXT, max_tokens=40, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    free = c.completions.create(**kwargs).choices[0]
    text = free.text
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 2) if text[i:i + 2].strip())
    at = text.find(stop)
    cut = c.completions.create(**kwargs, stop=[stop, "\x00never"]).choices[0]
    assert (cut.text, cut.finish_reason, cut.to_dict()["stop_reason"]) == (text[:at], "stop", stop)
    # the tokens end with the one that completes the stop string, a prefix of the free run's tokens
    tokens = cut.to_dict()["token_ids"]
    assert tokens == free.to_dict()["token_ids"][:len(tokens)] and len(tokens) < 40
    kept = c.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], "include_stop_str_in_output":
                                                             True}}, stop=stop).choices[0]
    assert kept.text == text[:at + len(stop)]
    # chat: the same rule
    chat_kwargs = dict(model=env["base"], messages=[{"role": "user", "content": "Say hi"}], max_tokens=30, seed=4,
                       extra_body={"ignore_eos": True})
    reply = c.chat.completions.create(**chat_kwargs).choices[0].message.content
    stop = next(reply[i] for i in range(len(reply) // 2, len(reply)) if reply[i].strip())
    cut = c.chat.completions.create(**chat_kwargs, stop=stop).choices[0]
    assert cut.message.content == reply[:reply.find(stop)] and cut.finish_reason == "stop"


def test_errors_in_the_openai_shape(env):
    import openai
    c = client(env)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["type"] == "NotFoundError" and e.value.body["param"] == "model"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        c.completions.create(model=env["base"], prompt="hi", max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="best_of"):
        c.completions.create(model=env["base"], prompt="hi", max_tokens=2, best_of=3)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        c.completions.create(model=env["base"], prompt="hi", max_tokens=2, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="n=1000"):
        c.completions.create(model=env["base"], prompt="hi", max_tokens=2, n=1000)
    with pytest.raises(openai.BadRequestError, match="logprobs=21"):
        c.completions.create(model=env["base"], prompt="hi", max_tokens=2, logprobs=21)
    assert_error(*post(env, "/v1/completions", None, raw=b'{"prompt": "hi", "max_tokens": 2'), 400, "not valid JSON")
    assert_error(*post(env, "/v1/completions", None, raw=b'[1, 2]'), 400, "JSON object")
    assert_error(*post(env, "/v1/completions", {"max_tokens": 2}), 422, "prompt")
    assert_error(*post(env, "/v1/completions", {"prompt": [[1, 2], "x"], "max_tokens": 2}), 422)
    assert_error(*post(env, "/v1/completions", {"prompt": [1, 10 ** 6]}), 400, "outside")
    assert_error(*post(env, "/v1/completions", {"prompt": "x", "stop_token_ids": [-3]}), 400, "outside")
    assert_error(*post(env, "/v1/chat/completions", {"messages": []}), 422, "messages")
    assert_error(*post(env, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                     "top_logprobs": 2}), 400, "logprobs=true")
    assert_error(*post(env, "/v1/nowhere", {}), 404)


def test_max_tokens_of_1e8_is_refused_and_the_next_request_is_served(env):
    status, payload = post(env, "/v1/completions", None, raw=b'{"prompt": "hi", "max_tokens": 1e8}')
    assert_error(status, payload, 400, f"maximum context length is {MAX_LEN}", "100000000 in the completion")
    ids = list(range(5, 250)) * 2  # 490 tokens: over max_prompt_len
    assert_error(*post(env, "/v1/completions", {"prompt": ids[:PROMPT_LEN], "max_tokens": MAX_LEN}), 400,
                 "maximum context length")
    assert_error(*post(env, "/v1/completions", {"prompt": ids}), 400, f"max_prompt_len {PROMPT_LEN}")
    status, payload = post(env, "/v1/completions", {"prompt": TEXT, "max_tokens": 3})
    assert status == 200 and payload["usage"]["completion_tokens"] == 3


def test_oversized_and_malformed_bodies_are_refused_without_reading_them(env):
    host, port = env["url"].split("//")[1].split(":")
    for length, code in (("-1", 400), ("99999999999", 413)):
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {length}\r\n\r\n".encode())
            head = sock.recv(4096).decode()
        assert head.startswith(f"HTTP/1.1 {code}"), head
    # a 20 MB text prompt is refused by its length in characters, before it is tokenized
    assert_error(*post(env, "/v1/completions", {"prompt": "a" * 20_000_000}), 400, "characters")
    status, payload = post(env, "/v1/completions", {"prompt": TEXT, "max_tokens": 2})
    assert status == 200


def test_200_concurrent_requests_all_answer_200(env):
    from jaxrl.backends.openai_client import http_json

    def one(i):  # no retries here: every connection must be taken and answered
        return http_json("POST", env["url"] + "/v1/completions",
                         {"prompt": f"{TEXT} {i}", "max_tokens": 4, "seed": i}, timeout=600)[0]

    with ThreadPoolExecutor(200) as pool:
        statuses = list(pool.map(one, range(200)))
    assert statuses == [200] * 200


def metrics(env) -> dict:
    conn = http.client.HTTPConnection(env["url"].split("//")[1], timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


def test_distinct_max_tokens_keep_compiled_programs_and_memory_flat(env):
    body = {"prompt": TEXT, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    for cap in (16, 64):  # one request per generation bucket this test reaches
        assert post(env, "/v1/completions", {**body, "max_tokens": cap})[0] == 200
    before = metrics(env)
    for cap in range(1, 61, 3):  # 20 distinct max_tokens
        status, payload = post(env, "/v1/completions", {**body, "max_tokens": cap})
        assert status == 200 and payload["usage"]["completion_tokens"] == cap
        assert payload["choices"][0]["finish_reason"] == "length"
    after = metrics(env)
    assert after["jaxrl:compiled_programs"] == before["jaxrl:compiled_programs"]
    grown = after["process_resident_memory_bytes"] - before["process_resident_memory_bytes"]
    assert grown < 64 * 2 ** 20, f"resident memory grew by {grown / 2 ** 20:.0f} MiB over 20 distinct max_tokens"


def test_runtime_adapter_loading_is_confined_to_the_allowed_roots(env):
    adapters = env["adapters"]
    assert_error(*post(env, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": env["base"]}), 400,
                 "not under the server's allowed adapter roots")
    assert_error(*post(env, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "adapters/a1"}), 400,
                 "absolute")
    escape = str(adapters / ".." / "base")  # resolved before the check
    assert_error(*post(env, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": escape}), 400, "not under")
    # inside the roots: a missing folder and a folder without an adapter get the same answer (no existence oracle)
    missing = post(env, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters / "nope")})
    empty = post(env, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters / "empty")})
    assert missing[0] == empty[0] == 400
    assert missing[1]["error"]["message"].replace("nope", "?") == empty[1]["error"]["message"].replace("empty", "?")
    status, text = post(env, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapters / "a1")})
    assert status == 200 and "added" in text
    base = post(env, "/v1/completions", {"prompt": TEXT, "max_tokens": 8, "seed": 1, "return_token_ids": True})
    tuned = post(env, "/v1/completions", {"model": "a1", "prompt": TEXT, "max_tokens": 8, "seed": 1,
                                          "return_token_ids": True})
    assert tuned[0] == 200 and tuned[1]["choices"][0]["token_ids"] != base[1]["choices"][0]["token_ids"]
    assert post(env, "/v1/unload_lora_adapter", {"lora_name": "a1"})[0] == 200


@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_evaluate_on_the_server_backend_at_its_default_concurrency(env, tmp_path):
    """64 prompts in flight at once (the backend's default concurrency, evaluate's default batch of 64)."""
    template = json.loads((ROOT / "jaxrl/assets/tasks/problems.jsonl").read_text().splitlines()[0])
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({**template, "id": f"p{i}", "messages": [
        {"role": "user", "content": f"Say hi {i}"}]}) + "\n" for i in range(72)))
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "launchers.evaluate", f"--base={env['base']}", f"--problems={problems}",
         f"--out={out}", "--backend=server", f"--server_url={env['url']}", "--num_samples=1",
         "--max_new_tokens=8", f"--max_prompt_len={PROMPT_LEN}", "--reward=test_generation_path:text_reward",
         "--dtype=float32", "--noprogress", "--n_resamples=100"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for path in out.rglob("*.jsonl") for line in path.read_text().splitlines()
            if '"problem_id"' in line]
    assert len({r["problem_id"] for r in rows}) == 72


# ------------------------------------------------------------------------------------------ lm-evaluation-harness

MC = [{"question": "Question: 2 + 2 = ?\nAnswer:", "choices": ["4", "5", "22"], "answer": 0},
      {"question": "Question: The capital of France is?\nAnswer:", "choices": ["Paris", "hello", "fox"], "answer": 0},
      {"question": "The quick brown", "choices": ["fox", "dog jumps"], "answer": 0}]
GEN = [{"question": "Question: 2 + 2 = ?\nAnswer:", "answer": " 4"}, {"question": "Say hi", "answer": " hi"}]


def lm_eval_tasks(folder: Path) -> Path:
    """Two local tasks, one per output type, on JSONL files in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, docs in (("mc", MC), ("gen", GEN)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        "task: jaxrl_tiny_mc\n" + common.format(path=folder / "mc.jsonl") +
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n")
    (folder / "gen.yaml").write_text(
        "task: jaxrl_tiny_gen\n" + common.format(path=folder / "gen.jsonl") +
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


def run_lm_eval(env, out: Path, model: str, tasks: str, *extra: str) -> dict:
    """`lm_eval --model <model>` (the CLI of docs/guides/lm-eval.md); returns {task: samples} of its output."""
    endpoint = "chat/completions" if "chat" in model else "completions"
    argv = [str(Path(sys.executable).parent / "lm_eval"), "--model", model, "--model_args",
            f"model={env['base']},base_url={env['url']}/v1/{endpoint},num_concurrent=4,max_length={MAX_LEN}",
            "--tasks", tasks, "--include_path", str(lm_eval_tasks(out / "tasks")), "--output_path",
            str(out / "results"), "--log_samples", *extra]
    proc = subprocess.run(argv, cwd=out, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    results = json.loads(next((out / "results").rglob("results_*.json")).read_text())
    samples = {}
    for path in (out / "results").rglob("samples_*.jsonl"):
        task = path.name[len("samples_"):].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return {"results": results["results"], "samples": samples}


def encode_pair(tok, context: str, continuation: str) -> tuple[list, list]:
    """lm-eval's own split of a (context, continuation) request into token ids (TemplateAPI._encode_pair)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx):]


@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_lm_eval_local_completions_multiple_choice_and_generate_until(env, tmp_path):
    got = run_lm_eval(env, tmp_path, "local-completions", "jaxrl_tiny_mc,jaxrl_tiny_gen")
    assert set(got["results"]) == {"jaxrl_tiny_mc", "jaxrl_tiny_gen"}
    assert got["results"]["jaxrl_tiny_mc"]["acc,none"] in (0.0, 1 / 3, 2 / 3, 1.0)
    mc = sorted(got["samples"]["jaxrl_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(mc) == len(MC)
    for sample, doc in zip(mc, MC):
        args = list(sample["arguments"].values())
        assert len(args) == len(doc["choices"])
        for arg, resp in zip(args, sample["resps"]):
            ctx, cont = encode_pair(env["tok"], arg["arg_0"], arg["arg_1"])
            ref, _ = teacher_forced(env, ctx + cont)
            # the log-likelihood of each choice is our own teacher-forced sum over its tokens
            assert float(resp[0][0]) == pytest.approx(float(ref[len(ctx) - 1:].sum()), abs=len(cont) * SCORED_ATOL)
        best = int(np.argmax([float(r[0][0]) for r in sample["resps"]]))
        assert sample["acc"] == float(best == doc["answer"])
    # generate_until: each answer is the server's greedy completion of the prompt, cut at "\n"
    c = client(env)
    gen = sorted(got["samples"]["jaxrl_tiny_gen"], key=lambda s: s["doc_id"])
    assert len(gen) == len(GEN)
    for sample, doc in zip(gen, GEN):
        ids = env["tok"](doc["question"], add_special_tokens=False)["input_ids"]
        want = c.completions.create(model=env["base"], prompt=ids, max_tokens=8, temperature=0.0, seed=1234,
                                    stop=["\n"]).choices[0].text
        assert sample["resps"][0][0] == want
        assert sample["exact_match"] == float(want.strip() == doc["answer"].strip())


@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_lm_eval_local_chat_completions_generate_until(env, tmp_path):
    got = run_lm_eval(env, tmp_path, "local-chat-completions", "jaxrl_tiny_gen", "--apply_chat_template")
    gen = sorted(got["samples"]["jaxrl_tiny_gen"], key=lambda s: s["doc_id"])
    c = client(env)
    for sample, doc in zip(gen, GEN):
        want = c.chat.completions.create(model=env["base"], messages=[{"role": "user", "content": doc["question"]}],
                                         max_tokens=8, temperature=0.0, seed=1234, stop=["\n"])
        assert sample["resps"][0][0] == want.choices[0].message.content
    assert "exact_match,none" in got["results"]["jaxrl_tiny_gen"]


# ------------------------------------------------------------------------------------------------ overload, signals


def test_overload_answers_503_a_long_chunked_body_413_and_sigint_exits_130(env):
    server = Served(env["root"], env["base"], *FLAGS, "--max_pending_rows=1", "--max_body_mb=0.01", name="small")
    try:
        conn = http.client.HTTPConnection(server.url.split("//")[1], timeout=60)
        body = json.dumps({"prompt": "a" * 20_000}).encode()  # 20 kB, sent without a length
        conn.request("POST", "/v1/completions", body=(body[i:i + 4096] for i in range(0, len(body), 4096)),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        assert_error(resp.status, json.loads(resp.read()), 413, "--max_body_mb")
        conn.close()

        statuses, bodies = [], []

        def one(i):
            status, payload = post({"url": server.url}, "/v1/completions",
                                   {"prompt": f"{TEXT} {i}", "max_tokens": 60, "seed": i, "ignore_eos": True})
            statuses.append(status)
            bodies.append(payload)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        for status, payload in zip(statuses, bodies):
            if status == 503:
                assert_error(status, payload, 503, "overloaded", "--max_pending_rows")
        assert server.stop(signal.SIGINT) == 130
        assert not server.ready.exists()
    finally:
        if server.proc.poll() is None:  # a failed assertion above: do not leave the server running
            server.stop(signal.SIGKILL)


def test_sigterm_finishes_the_request_in_flight_then_exits_143(env):
    """Last in this file: it stops the module's server. The request's prompt length (bucket 256) compiles new
    programs, so it is still running when the signal arrives."""
    server = env["server"]
    result = {}
    body = {"prompt": list(range(5, 105)), "max_tokens": 40, "seed": 9, "ignore_eos": True}
    t = threading.Thread(target=lambda: result.update(zip(("status", "payload"), post(env, "/v1/completions", body))))
    t.start()
    for _ in range(600):  # until the request is admitted
        if metrics(env)["jaxrl:num_rows_running"] + metrics(env)["jaxrl:num_rows_waiting"] >= 1:
            break
        time.sleep(0.05)
    assert server.stop(signal.SIGTERM) == 143
    t.join(60)
    assert result["status"] == 200 and result["payload"]["usage"]["completion_tokens"] == 40
    assert not server.ready.exists()
    assert "interrupted (SIGTERM)" in server.output()
