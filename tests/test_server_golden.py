"""`launchers.serve`'s answers to a fixed set of requests, against the answers it gave when they were recorded
(tests/golden.py): completions from text and token ids, n > 1, seeded sampling with top-p / top-k, greedy rows,
stop ids and stop strings (with and without the string in the output), log-probs with top-k, echo at max_tokens
0, chat with log-probs, streamed completions and chat, tokenize / detokenize and the refusals. Every token, text,
finish and stop reason must be identical and every log-probability within 1e-5; only the response ids and
creation times are left out."""

import http.client
import json

import pytest

import golden
from serve_fixture import Served, build_base

pytestmark = pytest.mark.slow  # a server process and its compilations

FLAGS = ("--max_model_len=512", "--max_prompt_len=128", "--prompt_buckets=64,128", "--generation_buckets=16,64",
         "--batch_size=8")
TEXT = "The quick brown fox jumps over the lazy dog."

REQUESTS = [
    ("/v1/completions", {"prompt": TEXT, "max_tokens": 12, "n": 2, "seed": 7, "temperature": 1.0, "logprobs": 0,
                         "return_token_ids": True}),
    ("/v1/completions", {"prompt": [[5, 6, 7, 8], [9, 10, 11]], "max_tokens": 20, "temperature": 0.0,
                         "stop_token_ids": [40, 41, 42], "return_token_ids": True, "logprobs": 0}),
    ("/v1/completions", {"prompt": "Say hi", "max_tokens": 40, "seed": 3, "stop": ["e", "o "],
                         "return_token_ids": True}),
    ("/v1/completions", {"prompt": "Say hi", "max_tokens": 40, "seed": 3, "stop": ["e", "o "],
                         "include_stop_str_in_output": True}),
    ("/v1/completions", {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 3}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 8, "seed": 1, "logprobs": 2}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 30, "seed": 2, "top_p": 0.9, "top_k": 20, "n": 3,
                         "return_token_ids": True}),
    ("/v1/completions", {"prompt": "The capital", "max_tokens": 70, "seed": 11, "temperature": 0.7,
                         "ignore_eos": True, "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 16, "seed": 4,
                              "logprobs": True, "top_logprobs": 2, "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "hello world"}],
                              "max_completion_tokens": 24, "temperature": 0.0}),
    ("/v1/completions", {"prompt": "The capital", "max_tokens": 10, "seed": 5, "stream": True, "logprobs": 1,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 10, "seed": 3,
                              "stream": True, "stream_options": {"include_usage": True}}),
    ("/tokenize", {"prompt": TEXT}),
    ("/detokenize", {"tokens": [5, 6, 7, 8, 9]}),
    ("/v1/completions", {"prompt": TEXT, "max_tokens": 100000}),
    ("/v1/completions", {"prompt": TEXT, "model": "no-such-model"}),
    ("/v1/completions", {"prompt": TEXT, "max_tokens": "many"}),
    ("/v1/completions", {"prompt": TEXT, "presence_penalty": 0.5}),
]
VOLATILE = ("id", "created")  # differ on every call: left out


def post(url: str, path: str, body: dict):
    """(status, parsed JSON) of a plain request; (status, [parsed SSE events]) of a streamed one."""
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=600)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    if body.get("stream") and resp.status == 200:
        events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
        return resp.status, [e if e == "[DONE]" else json.loads(e) for e in events]
    return resp.status, json.loads(text)


def stable(value):
    """The answer without its volatile fields."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_golden")
    base = build_base(root / "base", max_positions=512)
    server = Served(root, base, *FLAGS, "--served_model_name=base")
    yield server
    server.stop()


def test_the_servers_answers_to_a_fixed_set_of_requests_are_unchanged(served):
    answers = []
    for path, body in REQUESTS:
        status, payload = post(served.url, path, body)
        answers.append({"path": path, "request": body, "status": status, "answer": stable(payload)})
    statuses = [a["status"] for a in answers]
    assert statuses.count(200) == len(REQUESTS) - 4 and statuses[-4:] == [400, 404, 422, 400]
    golden.check_json("server_answers", answers)
