"""`distill.teacher_backend = "server"` and "vllm" (jaxrl/backends/teacher_client.py) against a real
`launchers.serve` process of the teacher folder at float32, over loopback (vLLM's `prompt_logprobs` form: the server
answers it as vLLM does): the same arrays as the in-process teacher (jaxrl/backends/jax_teacher.py), the same
losses, and a server that cannot serve refused before any step."""

import http.server
import json
import os
import socket
import threading

import numpy as np
import pytest

import hf_tiny
from serve_fixture import Served
from test_distill_task import distill_config
from jaxrl.backends.openai_client import ServerError, http_json
from jaxrl.backends.teacher_client import ServerTeacher, VLLMTeacher, rest_logp

K = 8


def _with_tokenizer(folder):
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    build_tiny_tokenizer(folder, ["abcdef ghij"], vocab_size=64, printable_ascii=False)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(teacher, student): tiny HF Qwen3.5 folders of one vocabulary (64) and one tokenizer (the server needs
    one; the run checks both sides hold the same)."""
    root = tmp_path_factory.mktemp("teacher_server")
    teacher, student = str(root / "teacher"), str(root / "student")
    hf_tiny.build_text(teacher, seed=7, vocab_size=64, num_hidden_layers=2)
    hf_tiny.build_text(student, seed=3, vocab_size=64, num_hidden_layers=2)
    return _with_tokenizer(teacher), _with_tokenizer(student)


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    # --max_logprobs above vLLM's default 20: k = 24 compiles the 32 bucket
    served = Served(tmp_path_factory.mktemp("served"), folders[0], "--max_model_len=64", "--max_prompt_len=64",
                    "--max_logprobs=32")
    yield served
    served.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rollout_arrays(n=6, P=6, C=8, seed=0):
    """Rows in the rollout layout: prompts of 2..P tokens left-padded, completions of 1..C right-padded, a
    completion mask with holes (an SFT row's loss_mask may have them)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((n, P + C), np.int32)
    attn = np.zeros((n, P + C), np.int32)
    cmask = np.zeros((n, C), np.float32)
    for i in range(n):
        p, c = int(rng.integers(2, P + 1)), int(rng.integers(1, C + 1))
        ids[i, P - p:P + c] = rng.integers(2, 64, p + c)
        attn[i, P - p:P + c] = 1
        cmask[i, :c] = 1
    cmask[0, 0] = 0
    cmask[-1] = 0  # a row with nothing to score
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": cmask}


@pytest.mark.slow
@pytest.mark.parametrize("client, k", [(ServerTeacher, K), (VLLMTeacher, K), (VLLMTeacher, 24)])
def test_server_teacher_arrays_equal_the_in_process_teachers(folders, server, client, k):
    """Both request forms (echo + logprobs; vLLM's prompt_logprobs), and a k over vLLM's default bound of 20."""
    from jaxrl.backends.jax_teacher import JaxTeacher
    arrays = rollout_arrays()
    local = JaxTeacher.load(folders[0], dtype="float32").score(arrays, k=k, temperature=1.0, batch_size=4)
    remote = client([server.url], k=k, width=14, vocab_size=64, teacher_path=folders[0]).score(
        arrays, k=k, temperature=1.0)
    for name in local:
        assert remote[name].shape == local[name].shape and remote[name].dtype == local[name].dtype, name
    mask = arrays["completion_mask"] > 0
    assert mask.sum() > 20
    np.testing.assert_array_equal(remote["top_ids"], local["top_ids"])
    np.testing.assert_allclose(remote["logp"], local["logp"], atol=1e-5)
    np.testing.assert_allclose(remote["top_logp"], local["top_logp"], atol=1e-5)
    # the remainder from 1 - sum(top k): its mass within float32 rounding of k entries
    np.testing.assert_allclose(np.exp(remote["rest_logp"][mask]), np.exp(local["rest_logp"][mask]), atol=1e-5)
    np.testing.assert_allclose(remote["rest_logp"][mask], local["rest_logp"][mask], atol=1e-4)
    for name in local:  # zero off the mask, as the in-process teacher
        assert not remote[name][~mask].any(), name


@pytest.mark.slow
def test_prompt_logprobs_come_in_vllms_shape(folders, server):
    """The answer a vLLM teacher parses, read raw: entry 0 null; entry j a dict of string ids -> {logprob, rank,
    decoded_token} holding the prompt token first (its rank in the whole vocabulary, from the in-process full
    ranking at k = V) and the top k at ranks 1..k (k entries when the token is among them, k + 1 when not); a k
    over --max_logprobs refused with vLLM's message."""
    from jaxrl.backends.jax_teacher import JaxTeacher
    seq = [int(t) for t in np.random.default_rng(1).integers(2, 64, 12)]
    status, body = http_json("POST", server.url + "/v1/completions", {
        "model": folders[0], "prompt": seq, "max_tokens": 1, "prompt_logprobs": K, "temperature": 0.0,
        "return_token_ids": True}, timeout=60)
    assert status == 200, body
    choice = body["choices"][0]
    plp = choice["prompt_logprobs"]
    assert choice["prompt_token_ids"] == seq and len(plp) == len(seq) and plp[0] is None
    # the full ranking: every position's 64 tokens, most likely first
    arrays = {"input_ids": np.array([seq]), "attention_mask": np.ones((1, 12), np.int32),
              "completion_mask": np.ones((1, 11), np.float32)}
    full = JaxTeacher.load(folders[0], dtype="float32").score(arrays, k=64, temperature=1.0, batch_size=1)
    sizes = set()
    for j in range(1, len(seq)):
        entry, order = plp[j], [int(t) for t in full["top_ids"][0, j - 1]]
        keys = list(entry)
        assert keys[0] == str(seq[j])  # the token's own entry first (kept there when it is also in the top k)
        assert entry[str(seq[j])]["rank"] == order.index(seq[j]) + 1
        sizes.add(len(entry))
        top = sorted((v["rank"], int(key)) for key, v in entry.items() if len(entry) == K or int(key) != seq[j])
        assert [r for r, _ in top] == list(range(1, K + 1)) and [t for _, t in top] == order[:K]
        for key, v in entry.items():
            np.testing.assert_allclose(v["logprob"], full["top_logp"][0, j - 1][order.index(int(key))], atol=1e-5)
            assert isinstance(v["decoded_token"], str)
    assert sizes == {K, K + 1}, sizes  # tokens inside and outside the top k both met
    status, body = http_json("POST", server.url + "/v1/completions", {
        "model": folders[0], "prompt": seq, "max_tokens": 1, "prompt_logprobs": 40}, timeout=60)
    assert status == 400 and "Requested prompt logprobs of 40, which is greater than max allowed: 32" in \
        body["error"]["message"], body
    status, body = http_json("POST", server.url + "/v1/completions", {
        "model": folders[0], "prompt": seq, "max_tokens": 1, "prompt_logprobs": 0, "stream": True}, timeout=60)
    assert status == 400 and body["error"]["param"] == "prompt_logprobs", body  # never silently dropped
    with pytest.raises(ServerError) as info:  # the client's probe: one line naming the server and the field
        VLLMTeacher([server.url], k=40, width=14)
    assert "\n" not in str(info.value) and server.url in str(info.value) and "prompt_logprobs=40" in str(info.value)


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_a_distill_run_on_the_teacher_server_has_the_in_process_losses(folders, server, tmp_path):
    """Two steps of forward_kl_topk at temperature 1, the teacher in this process vs on the server: every step's
    loss and distill/* metric within 1e-5 (fp32): the student samples the same rows, so the step-2 equality also
    says the updates were the same."""
    from jaxrl.algorithms.run import run_training
    teacher, student = folders
    runs = {}
    for backend in ("jax", "server", "vllm"):
        block = {"teacher_servers": (server.url,)} if backend != "jax" else {}
        cfg = distill_config(teacher, student, temperature=1.0, teacher_backend=backend, **block)
        cfg.steps = 2
        cfg.checkpoint_every = 2
        runs[backend] = run_training(cfg, str(tmp_path / backend)).records
    for a, b, c in zip(runs["jax"], runs["server"], runs["vllm"]):
        for key in ("loss", "distill/reverse_kl", "distill/teacher_logp", "distill/top1_agreement",
                    "distill/outside_topk", "grad_norm"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-5, err_msg=key)
            np.testing.assert_allclose(c[key], a[key], rtol=1e-5, atol=1e-5, err_msg=key)
    print("losses", [r["loss"] for r in runs["server"]])


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_a_down_teacher_server_is_refused_before_any_step_and_the_run_resumes_once_it_is_up(folders, tmp_path):
    from jaxrl.algorithms.run import run_training
    teacher, student = folders
    url = f"http://127.0.0.1:{_free_port()}"
    workdir = str(tmp_path / "run")

    def config():
        cfg = distill_config(teacher, student, temperature=1.0, teacher_backend="server", teacher_servers=(url,))
        cfg.steps = 1
        cfg.checkpoint_every = 1
        return cfg

    with pytest.raises(ServerError) as info:
        run_training(config(), workdir)
    message = str(info.value)
    assert "\n" not in message and url in message and "distill.teacher_servers" in message, message
    assert not os.path.exists(workdir) or not os.listdir(workdir), os.listdir(workdir)
    served = Served(tmp_path, teacher, "--max_model_len=64", f"--port={url.rsplit(':', 1)[1]}")
    try:
        assert served.url == url
        records = run_training(config(), workdir).records
    finally:
        served.stop()
    assert [r["step"] for r in records] == [1] and np.isfinite(records[0]["loss"])


# --------------------------------------------------------------------------------- servers that cannot serve


class _Fake(http.server.BaseHTTPRequestHandler):
    """An OpenAI-lookalike that lists a model and answers completions with `answer` (set per server)."""

    answer = b""

    def do_GET(self):
        self._send(json.dumps({"data": [{"id": "teacher", "root": "teacher", "parent": None}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(self.answer(body) if callable(self.answer) else self.answer)

    def _send(self, raw: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


def _fake(answer):
    handler = type("Handler", (_Fake,), {"answer": staticmethod(answer) if callable(answer) else answer})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def _refused_naming_it(teacher_class, answer, needle):
    """A teacher of `teacher_class` probing a fake server that gives `answer` is refused in one line naming the
    server and `needle`."""
    httpd, url = _fake(answer)
    try:
        with pytest.raises(ServerError) as info:
            teacher_class([url], k=K, width=14)
    finally:
        httpd.shutdown()
    message = str(info.value)
    assert "\n" not in message and url in message and needle in message, message


def _echo(top):
    """An echo answer whose every position has `top` entries."""
    def answer(body):
        seq = body["prompt"]
        tops = [None] + [{f"token_id:{t}": -1.0 - t for t in range(top)} for _ in seq[1:]]
        return json.dumps({"choices": [{"logprobs": {"tokens": [f"token_id:{t}" for t in seq],
                                                     "token_logprobs": [None] + [-1.0] * (len(seq) - 1),
                                                     "top_logprobs": tops}}]}).encode()
    return answer


@pytest.mark.parametrize("answer, needle", [
    (b"<html>oops</html>", "not an echoed completion"),
    (_echo(K - 1), f"returned {K - 1} top log-probs at position 1, fewer than distill.teacher_top_k={K}"),
])
def test_a_teacher_server_answering_garbage_or_fewer_than_k_is_refused_naming_it(answer, needle):
    _refused_naming_it(ServerTeacher, answer, needle)


def _prompt_logprobs(entries):
    """A vLLM answer whose every position holds `entries(sequence, j)` (a dict "id" -> {logprob, rank})."""
    def answer(body):
        seq = body["prompt"]
        plp = [None] + [entries(seq, j) for j in range(1, len(seq))]
        return json.dumps({"choices": [{"text": "", "prompt_logprobs": plp}]}).encode()
    return answer


def _ranked(own_rank):
    """The prompt token at `own_rank` (over K: outside the top K) and the top K = ids 1..K, in a shuffled order."""
    def entries(seq, j):
        top = [(i + 1, -1.0 - i, i + 1) for i in range(K)]  # (id, logprob, rank)
        out = {str(seq[j]): {"logprob": -50.0 if own_rank > K else -1.0 - (own_rank - 1), "rank": own_rank,
                             "decoded_token": "x"}}
        for i in np.random.default_rng(j).permutation(K):
            t, v, r = top[i]
            out.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": "x"})
        return out
    return entries


@pytest.mark.parametrize("answer, needle", [
    (b'{"choices": [{"text": "x"}]}', "without a choice's prompt_logprobs list"),
    (_prompt_logprobs(lambda seq, j: {str(t): {"logprob": -1.0, "rank": t + 1} for t in range(K - 1)}),
     f"fewer than distill.teacher_top_k={K}"),
    (_prompt_logprobs(lambda seq, j: {str(1000 + t): {"logprob": -1.0, "rank": t + 1} for t in range(K)}),
     "without the prompt token's own entry"),
])
def test_a_vllm_teacher_answering_garbage_or_fewer_than_k_is_refused_naming_it(answer, needle):
    _refused_naming_it(VLLMTeacher, answer, needle)


@pytest.mark.parametrize("own_rank", [3, K + 5])
def test_the_vllm_parse_orders_by_rank_and_drops_the_token_outside_the_top_k(own_rank):
    """k + 1 entries (the token outside the top k): the k ranked 1..k, in rank order whatever the dict's; k entries
    (the token inside): all of them. The token's own log-prob is its entry's either way."""
    httpd, url = _fake(_prompt_logprobs(_ranked(own_rank)))
    arrays = rollout_arrays()
    # every token is id own_rank (inside the top K = ids 1..K), or id 40 (outside)
    token = own_rank if own_rank <= K else 40
    arrays["input_ids"] = np.where(arrays["attention_mask"] > 0, token, 0).astype(np.int32)
    try:
        out = VLLMTeacher([url], k=K, width=14).score(arrays, k=K, temperature=1.0)
    finally:
        httpd.shutdown()
    mask = arrays["completion_mask"] > 0
    assert (out["top_ids"][mask] == np.arange(1, K + 1)).all()
    np.testing.assert_allclose(out["top_logp"][mask], np.broadcast_to(-1.0 - np.arange(K), (mask.sum(), K)))
    np.testing.assert_allclose(out["logp"][mask], -50.0 if own_rank > K else -1.0 - (own_rank - 1))


def test_the_probe_reads_k_entries_most_likely_first():
    """A dict of k + 1 entries (the token itself outside the top k, as vLLM and ours add it) gives the k most
    likely, in order; the remainder is 1 - their mass."""
    httpd, url = _fake(_echo(K + 1))
    try:
        teacher = ServerTeacher([url], k=K, width=14)
        out = teacher.score(rollout_arrays(), k=K, temperature=1.0)
    finally:
        httpd.shutdown()
    mask = rollout_arrays()["completion_mask"] > 0
    assert (out["top_ids"][mask] == np.arange(K)).all()
    np.testing.assert_allclose(out["top_logp"][mask], np.broadcast_to(-1.0 - np.arange(K), (mask.sum(), K)))
    np.testing.assert_allclose(out["rest_logp"][mask], np.log(1 - np.exp(-1.0 - np.arange(K)).sum()), rtol=1e-6)
    assert rest_logp(np.log(np.full(4, 0.3)))[()] == -1.0e4  # no mass left (rounding, k = V): the floor


def test_a_teacher_server_config_that_cannot_work_is_refused(folders, tmp_path):
    from jaxrl.algorithms.run import run_training
    teacher, student = folders
    cases = [({"teacher_backend": "server"}, "distill.teacher_servers"),
             ({"teacher_servers": ("http://127.0.0.1:1",)}, "teacher_backend 'server' | 'vllm'"),
             ({"teacher_backend": "vllm"}, "vllm serve <teacher_path> --max-logprobs"),
             ({"teacher_backend": "server", "teacher_servers": ("http://127.0.0.1:1",)}, "distill.temperature is 0.3"),
             ({"teacher_backend": "server", "teacher_servers": ("x",), "temperature": 1.0}, "not base URLs")]
    for n, (block, needle) in enumerate(cases):
        with pytest.raises(ValueError) as info:
            run_training(distill_config(teacher, student, **block), str(tmp_path / f"run{n}"))
        assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.heavy  # a served teacher SIGKILLed under a running distillation, then restarted
def test_a_teacher_server_killed_mid_run_fails_one_line_and_the_run_resumes_from_its_checkpoint(folders, tmp_path):
    """The only server dies after step 2 of 6 (checkpoints every step): with no teacher server left the step waits
    `distill.teacher_server.fleet_wait_s` (2 s here) for one to answer again, then the run stops with one line naming
    it (FleetLost); a server started again on the same port lets the same command resume from the last checkpoint
    and finish, its records the steps after that checkpoint. (A fleet of several keeps going: tests/test_fleet.py.)"""
    import signal
    import time
    from jaxrl.algorithms.run import run_training
    from jaxrl.train.metrics import read_metrics
    teacher, student = folders
    served = Served(tmp_path, teacher, "--max_model_len=64", name="first")
    url, workdir = served.url, str(tmp_path / "run")

    def config():
        cfg = distill_config(teacher, student, temperature=1.0, teacher_backend="server", teacher_servers=(url,))
        cfg.steps = 6
        cfg.checkpoint_every = 1
        cfg.distill.teacher_server.fleet_wait_s = 2.0
        return cfg

    failure = []

    def train():
        try:
            run_training(config(), workdir)
        except Exception as e:  # noqa: BLE001 - the test reads it
            failure.append(e)

    thread = threading.Thread(target=train)
    thread.start()
    metrics = os.path.join(workdir, "metrics.jsonl")
    while thread.is_alive() and not (os.path.exists(metrics) and len(read_metrics(workdir)) >= 2):
        time.sleep(0.2)
    served.stop(signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive()
    from jaxrl.backends.fleet import FleetLost
    assert len(failure) == 1 and isinstance(failure[0], FleetLost), failure
    message = str(failure[0])
    assert "\n" not in message and url in message and "distill.teacher_server.fleet_wait_s" in message, message
    done = [r["step"] for r in read_metrics(workdir)]
    assert 2 <= done[-1] < 6, done
    again = Served(tmp_path, teacher, "--max_model_len=64", f"--port={url.rsplit(':', 1)[1]}", name="second")
    try:
        assert again.url == url
        records = run_training(config(), workdir).records
    finally:
        again.stop()
    assert [r["step"] for r in records] == list(range(done[-1] + 1, 7)), [r["step"] for r in records]
    assert all(np.isfinite(r["loss"]) for r in records)
    print("failed after step", done[-1], "with:", message)


# --------------------------------------------------------------------------------- the specs that build them


def test_the_teacher_backends_are_the_scorer_specs():
    from jaxrl.backends.scorers import SCORER_SPECS, JaxTeacherSpec, ServerTeacherSpec, VLLMTeacherSpec
    from jaxrl.backends.settings import SERVED_TEACHERS, TEACHER_BACKENDS
    assert TEACHER_BACKENDS == tuple(SCORER_SPECS) == ("jax", "server", "vllm")
    assert SERVED_TEACHERS == ("server", "vllm")
    assert [SCORER_SPECS[n] for n in TEACHER_BACKENDS] == [JaxTeacherSpec, ServerTeacherSpec, VLLMTeacherSpec]


def _teacher_block(teacher, backend, **block):
    from jaxrl.algorithms.distill_config import DistillConfig
    return DistillConfig(teacher_path=teacher, teacher_backend=backend, temperature=1.0, teacher_top_k=K, **block)


def test_the_jax_spec_builds_the_in_process_teacher(folders):
    """distill.teacher_backend='jax' (+ teacher_adapter '') -> JaxTeacherSpec -> a JaxTeacher (a Scorer) of the
    teacher folder, loaded in the context's dtype."""
    from jaxrl.backends.base import Scorer
    from jaxrl.backends.jax_teacher import JaxTeacher
    from jaxrl.backends.scorers import JaxTeacherSpec, ScorerContext
    spec = _teacher_block(folders[0], "jax").teacher_spec
    assert spec == JaxTeacherSpec(folders[0], "") and not spec.served
    teacher = spec.build(ScorerContext(width=14, top_k=K, vocab_size=64, dtype="float32"))
    assert type(teacher) is JaxTeacher and isinstance(teacher, Scorer) and teacher.name == "jax"
    assert teacher.model.embed_tokens[...].dtype == np.float32
    out = teacher.score(rollout_arrays(), k=K, temperature=1.0, batch_size=4)
    assert {k: v.shape for k, v in out.items()} == {"logp": (6, 8), "top_logp": (6, 8, K), "top_ids": (6, 8, K),
                                                     "rest_logp": (6, 8)}
    teacher.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["server", "vllm"])
def test_a_served_spec_builds_its_client_probed_against_the_real_server(folders, server, backend):
    """distill.teacher_backend='server' | 'vllm' with the block's teacher_servers and teacher_server options ->
    ServerTeacherSpec | VLLMTeacherSpec -> the client of that class, which probed the running launchers.serve at
    the context's width and k, with those options; it scores as a Scorer."""
    from jaxrl.backends.base import Scorer
    from jaxrl.backends.options import ServerOptions
    from jaxrl.backends.scorers import SCORER_SPECS, ScorerContext
    options = ServerOptions(concurrency=3, request_timeout_s=120.0, progress_every_s=0.0)
    spec = _teacher_block(folders[0], backend, teacher_servers=(server.url,), teacher_server=options).teacher_spec
    assert type(spec) is SCORER_SPECS[backend] and spec.served
    assert (spec.urls, spec.options, spec.path) == ((server.url,), options, folders[0])
    teacher = spec.build(ScorerContext(width=14, top_k=K, vocab_size=64))
    assert type(teacher) is {"server": ServerTeacher, "vllm": VLLMTeacher}[backend]
    assert isinstance(teacher, Scorer) and teacher.name == backend
    assert (teacher.urls, teacher.k, teacher.width, teacher.vocab_size) == ([server.url], K, 14, 64)
    assert (teacher.concurrency, teacher.timeout_s, teacher.progress_every_s) == (3, 120.0, 0.0)
    out = teacher.score(rollout_arrays(), k=K, temperature=1.0)
    assert out["top_ids"].shape == (6, 8, K) and np.isfinite(out["logp"]).all()
    teacher.close()


def _echo_with(own, top_value):
    """An echo answer whose positions all hold `own` as the token's log-prob and `top_value` in every top entry."""
    def answer(body):
        seq = body["prompt"]
        tops = [None] + [{f"token_id:{t}": top_value for t in range(K)} for _ in seq[1:]]
        return json.dumps({"choices": [{"logprobs": {"tokens": [f"token_id:{t}" for t in seq],
                                                     "token_logprobs": [None] + [own] * (len(seq) - 1),
                                                     "top_logprobs": tops}}]}).encode()
    return answer


@pytest.mark.parametrize("answer, needle", [
    (_echo_with(5.0, -3.0), "returned a token's log-prob of 5.0 at position 1"),
    (_echo_with(float("nan"), -3.0), "returned a token's log-prob of nan at position 1"),
    (_echo_with(-1.0, float("nan")), "returned a top-k log-prob of nan at position 1"),
    (_echo_with(-1.0, -0.1), "sum to"),
])
def test_a_teacher_server_answering_impossible_logprobs_fails_naming_it(answer, needle):
    """Reproduction (2e1e1a6): a teacher server answering log-probs of +5.0 was trained on (loss about 12,300, exit
    0); one answering NaN had every update skipped as "non-finite gradients" without naming the server. Each served
    log-prob is now checked (finite, <= 0, the top k a distribution) and a bad answer fails its request naming
    the server."""
    _refused_naming_it(ServerTeacher, answer, needle)


def test_a_vllm_teacher_answering_a_positive_logprob_fails_naming_it():
    def entries(seq, j):
        out = {str(t + 1): {"logprob": -1.0 - t, "rank": t + 1} for t in range(K)}
        out[str(seq[j])] = {"logprob": 2.5, "rank": 99}
        return out
    _refused_naming_it(VLLMTeacher, _prompt_logprobs(entries), "returned a token's log-prob of 2.5 at position 1")
