"""Partial rollouts on a real `launchers.serve` process over loopback: an adapter reloaded in place while a row of a
`partial_rollout` request runs switches that row at the next round end (no drain), and the row's `token_versions`
tag both halves with the digest the server reported for each adapter; every log-prob is the one the sampler drew
with, reproduced by a teacher-forced pass whose cache holds the prefix the old adapter wrote and whose rest is fed to
the new one. A request that did not ask for it keeps its adapter for the whole row (the reload waits for a drain),
as before; the extension fields appear only when asked for."""

import http.client
import json
import threading
import time

import numpy as np
import pytest

from serve_fixture import Served, build_base

pytestmark = pytest.mark.heavy

MAX_LEN = 1024
CAP = 900  # long rows: the reload must land while the row runs
PROMPT = [11, 42, 7, 99, 23, 5]
SAMPLED_ATOL = 2e-4  # the sampler's decode path vs the chunked teacher-forced pass, fp32 (test_server_api)


def call(url, method, path, body=None):
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=600)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, (json.loads(text) if text.startswith(("{", "[")) else text)


def metrics(url) -> dict:
    text = call(url, "GET", "/metrics")[1]
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


def served_digest(url, name):
    return next(m["adapter_digest"] for m in call(url, "GET", "/v1/models")[1]["data"] if m["id"] == name)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import jax.numpy as jnp

    from jaxrl.models.peft import export_peft
    from jaxrl.models import qwen35
    from jaxrl.models.adapters import Adapter
    from jaxrl.models.lora import linears

    root = tmp_path_factory.mktemp("serve_partial")
    base = build_base(root / "base", max_positions=MAX_LEN)
    model = qwen35.from_pretrained(base, dtype=jnp.float32)
    lin = dict(linears(model))
    adapters = root / "adapters"
    for k, name in enumerate(("a1", "a2")):
        rng = np.random.default_rng(10 + k)
        params = {}
        for m in ("layers.0.mlp.down_proj", "layers.1.self_attn.q_proj", "layers.1.mlp.down_proj"):
            params[m + ".lora.lora_A"] = (0.5 * rng.standard_normal((2, lin[m].in_features))).astype(np.float32)
            params[m + ".lora.lora_B"] = (0.5 * rng.standard_normal((lin[m].out_features, 2))).astype(np.float32)
        export_peft(Adapter(params=params, rank=2, alpha=4.0, source="test"), str(adapters / name), base)
    server = Served(root, base, f"--allowed_lora_roots={adapters}", f"--max_model_len={MAX_LEN}", "--batch_size=4",
                    "--round_steps=4")
    yield {"url": server.url, "model": model, "adapters": adapters, "server": server, "base": base}
    server.stop()


def forward_with(model, folder):
    """A jitted `model(ids, cache=)` of the base with the adapter in `folder` attached (fp32)."""
    import jax
    from flax import nnx

    from jaxrl.models.peft import read_peft_adapter
    from jaxrl.models.adapters import attach, detach

    attach(model, read_peft_adapter(str(folder))[0])
    graphdef, state = nnx.split(model)
    detach(model)
    return jax.jit(lambda ids, cache: nnx.merge(graphdef, state)(ids, cache=cache))


def mixed_logprobs(model, first, second, prompt, tokens, boundary):
    """log p(tokens[t]) for every t: the prompt and tokens[:boundary - 1] go through `first` (their cache), the
    rest through `second` (token boundary - 1 is the first input the new weights read)."""
    import jax

    cache = model.init_cache(1, len(prompt) + len(tokens))
    ids = list(prompt) + list(tokens)
    cut = len(prompt) + max(boundary - 1, 0)
    a, cache = first(np.asarray([ids[:cut]], np.int32), cache)
    b, _ = second(np.asarray([ids[cut:-1]], np.int32), cache)
    logits = np.concatenate([np.asarray(a[0]), np.asarray(b[0])])[len(prompt) - 1:]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(np.float32), axis=-1))
    return logp[np.arange(len(tokens)), tokens]


def reload_mid_row(env, name, partial: bool) -> tuple[dict, str, str]:
    """Loads a1 as `name`, starts one long row of it, reloads a2 in place under `name` once the row has decoded a
    while (checking it still runs afterwards); returns the choice and the digests the server reported."""
    url, adapters = env["url"], env["adapters"]
    assert call(url, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters / "a1")})[0] == 200
    first = served_digest(url, name)
    body = {"model": name, "prompt": PROMPT, "max_tokens": CAP, "temperature": 1.0, "seed": 3, "logprobs": 0,
            "ignore_eos": True, "return_token_ids": True, "return_token_versions": True, "partial_rollout": partial}
    out = {}
    worker = threading.Thread(target=lambda: out.update(answer=call(url, "POST", "/v1/completions", body)))
    before = metrics(url)["jaxrl:engine_decode_steps_total"]
    worker.start()
    deadline = time.monotonic() + 300
    while metrics(url)["jaxrl:engine_decode_steps_total"] < before + 40:
        assert time.monotonic() < deadline and worker.is_alive(), out
        time.sleep(0.02)
    status, _ = call(url, "POST", "/v1/load_lora_adapter",
                     {"lora_name": name, "lora_path": str(adapters / "a2"), "load_inplace": True})
    assert status == 200
    second = served_digest(url, name)
    assert metrics(url)["jaxrl:num_rows_running"] == 1  # the reload landed while the row ran
    worker.join(600)
    status, answer = out["answer"]
    assert status == 200, answer
    return answer["choices"][0], first, second


def test_an_adapter_reloaded_mid_row_continues_the_row_and_tags_both_halves(env):
    url, model = env["url"], env["model"]
    swaps = metrics(url)["jaxrl:weight_swaps_in_flight_total"]
    choice, d1, d2 = reload_mid_row(env, "policy", partial=True)
    assert d1 != d2 and metrics(url)["jaxrl:weight_swaps_in_flight_total"] == swaps + 1
    tokens, versions = choice["token_ids"], choice["token_versions"]
    assert len(tokens) == len(versions) == CAP and choice["version_digests"] == [d1, d2]
    boundary = versions.index(1)
    assert 0 < boundary < CAP and versions == [0] * boundary + [1] * (CAP - boundary)
    got = np.asarray(choice["logprobs"]["token_logprobs"], np.float64)
    a1, a2 = forward_with(model, env["adapters"] / "a1"), forward_with(model, env["adapters"] / "a2")
    want = mixed_logprobs(model, a1, a2, PROMPT, tokens, boundary)
    np.testing.assert_allclose(got, want, atol=SAMPLED_ATOL)
    for first, second in ((a1, a1), (a2, a2)):  # either adapter alone is told apart, before or after the boundary
        alone = mixed_logprobs(model, first, second, PROMPT, tokens, boundary)
        half = slice(boundary, None) if first is a1 else slice(0, boundary)
        assert np.abs(alone[half] - want[half]).max() > 1e-2


def test_a_request_without_partial_rollouts_keeps_its_adapter_for_the_whole_row(env):
    url, model = env["url"], env["model"]
    swaps = metrics(url)["jaxrl:weight_swaps_in_flight_total"]
    choice, d1, d2 = reload_mid_row(env, "fixed", partial=False)
    assert d1 != d2 and metrics(url)["jaxrl:weight_swaps_in_flight_total"] == swaps
    tokens = choice["token_ids"]
    assert choice["version_digests"] == [d1] and choice["token_versions"] == [0] * CAP
    a1 = forward_with(model, env["adapters"] / "a1")
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], mixed_logprobs(model, a1, a1, PROMPT, tokens, 1),
                               atol=SAMPLED_ATOL)
    # the next request of that name samples the reloaded adapter; without the flags, no extension fields
    status, answer = call(url, "POST", "/v1/completions", {"model": "fixed", "prompt": PROMPT, "max_tokens": 4,
                                                           "return_token_versions": True})
    assert status == 200 and answer["choices"][0]["version_digests"] == [d2]
    status, answer = call(url, "POST", "/v1/chat/completions", {
        "model": "fixed", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "n": 2,
        "return_token_versions": True, "return_token_ids": True})
    assert status == 200, answer
    for choice in answer["choices"]:
        assert choice["version_digests"] == [d2] and choice["token_versions"] == [0] * len(choice["token_ids"])
    status, answer = call(url, "POST", "/v1/completions", {"model": "fixed", "prompt": PROMPT, "max_tokens": 4})
    assert status == 200 and "token_versions" not in answer["choices"][0]
    status, answer = call(url, "POST", "/v1/completions", {"model": "fixed", "prompt": PROMPT, "max_tokens": 4,
                                                           "stream": True, "partial_rollout": True})
    assert status == 400 and answer["error"]["param"] == "partial_rollout"


def test_the_server_backend_keeps_each_tokens_digest(env, tmp_path):
    """`ServerBackend(return_token_versions=True)`: every Generation carries the digest of each of its tokens, the
    one the server reports serving (`loaded_digest`); without the flag none is asked for."""
    from jaxrl.backends.base import ModelSpec, SamplingParams
    from jaxrl.backends.openai_client import ServerBackend
    from jaxrl.models.peft import read_peft_adapter

    folder = env["adapters"] / "a1"
    adapter = read_peft_adapter(str(folder))[0]
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=4)
    digests = {}
    for asked in (True, False):
        backend = ServerBackend(env["base"], url=env["url"], out_dir=str(tmp_path), stop_ids=(),
                                return_token_versions=asked)
        backend.load(ModelSpec("client", "adapter", str(folder)), adapter)
        gens = backend.generate([PROMPT, PROMPT[:3]], [0, 1], sampling)
        assert len(gens) == 4 and all(len(g.tokens) == 6 for g in gens)
        digests[asked] = [g.token_digests for g in gens]
        assert backend.loaded_digest() == adapter.digest()
        backend.close()
    assert digests[True] == [[adapter.digest()] * 6] * 4 and digests[False] == [None] * 4
