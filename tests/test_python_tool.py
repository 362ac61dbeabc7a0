"""The `python_tool` environment (jaxrl.environments.python_tool.PythonTool) on the real sandbox: a tool call's
output comes back as a `tool` message, a turn without a call is the final answer scored by the verifier, a
malformed call is an error observation and the episode goes on, hostile tool programs are contained as the
verifier's are; and an episode of hand-written turns (a random tiny model cannot sample a valid call) through the
EpisodeRunner is one token sequence: the policy's ids where it sampled (mask 1, its log-probs), the template's
delta of the tool messages where the environment spoke (mask 0), the tools rendered into the first prompt."""

import time

import pytest

from jaxrl.environments.base import Turn
from jaxrl.environments.python_tool import PYTHON_TOOL, PythonTool
from jaxrl.environments.registry import ENVIRONMENTS
from jaxrl.environments.runner import EpisodeRunner
from jaxrl.backends.base import Generation, RolloutBackend
from jaxrl.backends import SamplingParams
from jaxrl.data.chat import format_chat, load_tokenizer, turn_delta_ids
from jaxrl.data.problems import Problem
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
from jaxrl.rollout.collect import Collector
from test_environments import HOSTILE
from test_verifier_hostile import HOSTILE_TIMEOUT_S, sandbox_leftovers  # noqa: E402 - tests/ on the path

SUM = Problem.from_dict({
    "id": "sum", "messages": [{"role": "user", "content": "Print a + b."}], "test_type": "stdin",
    "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"},
              {"input": "-5 3\n", "output": "-2\n"}, {"input": "7 -7\n", "output": "0\n"}],
    "time_limit_s": 20.0})
ANSWER = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def call(code, before="Let me run it.\n"):
    return (f"{before}<tool_call>\n<function=python>\n<parameter=code>\n{code}\n</parameter>\n</function>\n"
            "</tool_call>")


def turn(text, index=0, last=False, finish="stop"):
    return Turn(text, (1, 2), finish, index, last)


def env(**options):
    e = ENVIRONMENTS.get("python_tool")(workers=2, timeout_s=20.0, **options)
    e.reset(SUM)
    return e


def test_a_tool_calls_output_comes_back_as_a_tool_message():
    e = env()
    assert e.tools == [PYTHON_TOOL]
    two = call("import sys\nprint(2 + 3)\nprint('careful', file=sys.stderr)\n1 / 0") + "\n" + call("def f(:", "")
    messages, reward, done = e.step(turn(two))
    assert not done and reward == 0.0 and [m["role"] for m in messages] == ["tool", "tool"]
    first, second = messages[0]["content"], messages[1]["content"]
    assert first.startswith("5\ncareful\nTraceback") and first.endswith("ZeroDivisionError: division by zero")
    assert "_sandbox_server" not in first and 'File "/tmp/work/solution.py", line 4' in first  # the program's frame
    assert second.startswith("SyntaxError:")
    messages, _, done = e.step(turn(call("x = 1"), index=1))
    assert not done and messages == [{"role": "tool", "content": "(no output)"}]
    messages, _, _ = e.step(turn(call("print(input())"), index=2))  # no stdin: the tool is not a test
    assert "EOFError" in messages[0]["content"]


def test_a_turn_without_a_call_is_the_final_answer_scored_on_the_tests():
    e = env(turn_cost=0.1)
    _, reward, done = e.step(turn(call("print(1)")))
    assert not done and reward == pytest.approx(-0.1)
    _, reward, done = e.step(turn(ANSWER, index=1))
    assert done and reward == 1.0 and e.solved is True
    half = "```python\na, b = map(int, input().split())\nprint(a + b if a > 0 else 0)\n```"  # fails "-5 3"
    e = env()  # a call mentioned while thinking is not a call: the answer after </think> is scored
    _, reward, done = e.step(turn("<think>\nMaybe a <tool_call> first? No.\n</think>\n\n" + ANSWER))
    assert done and reward == 1.0
    e = env()
    messages, _, done = e.step(turn("<think>\nRun it.\n</think>\n\n" + call("print(1)", "")))
    assert not done and messages == [{"role": "tool", "content": "1"}]
    e = env()
    _, reward, done = e.step(turn(half))
    assert done and reward == pytest.approx(0.75) and e.solved is False
    e = env(score="strict")
    assert e.step(turn(half))[1:] == (0.0, True)
    e = env()
    assert e.step(turn(ANSWER, finish="length"))[1:] == (0.0, True)  # cut at its cap: 0, as a truncated completion


@pytest.mark.parametrize("text,why", [
    (call("print(1)").replace("</tool_call>", ""), "write each call as"),  # unclosed
    (call("print(1)") + "\nand then an answer", "write each call as"),  # text after the call
    (call("print(1)").replace("=python", "=bash"), "write each call as"),  # a tool that is not offered
    ("<tool_call>\n<function=python>\n<parameter=source>\nprint(1)\n</parameter>\n</function>\n</tool_call>",
     "has no `code`"),
], ids=["unclosed", "trailing_text", "other_tool", "no_code"])
def test_a_malformed_call_is_an_error_observation_and_the_episode_goes_on(text, why):
    e = env()
    messages, reward, done = e.step(turn(text))
    assert not done and reward == 0.0 and messages[0]["role"] == "user" and why in messages[0]["content"]
    _, reward, done = e.step(turn(ANSWER, index=1))
    assert done and reward == 1.0


def test_a_call_on_the_last_turn_ends_the_episode_unanswered():
    e = env()
    messages, reward, done = e.step(turn(call(ANSWER.strip("`").removeprefix("python\n")), last=True))
    assert done and messages == [] and reward == 0.0 and e.solved is False


def test_tool_output_keeps_both_ends_within_its_budget():
    e = env(output_chars=300)
    (m,), _, _ = e.step(turn(call("print('x' * 5000)\nraise ValueError('the end')")))
    text = m["content"]
    assert len(text) <= 300 and "the middle cut" in text and text.startswith("xxx")
    assert text.endswith("ValueError: the end")


@pytest.mark.parametrize("code,status", [(HOSTILE["fork_bomb"], "time limit"), (HOSTILE["sleep"], "time limit"),
                                         (HOSTILE["flood"], "output limit")], ids=["fork_bomb", "sleep", "flood"])
def test_hostile_tool_calls_are_contained(code, status):
    """The tool's program runs in the verifier's sandbox: killed in time, the reason told to the model, nothing
    left running (tests/test_verifier_hostile.py's patterns)."""
    e = ENVIRONMENTS.get("python_tool")(workers=2, tool_timeout_s=HOSTILE_TIMEOUT_S, output_chars=500)
    e.reset(SUM)
    if "fork" in code and not e.verifier.pool.isolation.uid:
        pytest.skip("RLIMIT_NPROC binds only off root: a fork bomb needs the uid sandbox")
    started = time.monotonic()
    (m,), reward, done = e.step(turn(call(code)))
    assert time.monotonic() - started < 60
    assert not done and m["role"] == "tool" and f"[killed: {status}" in m["content"] and len(m["content"]) <= 500
    assert sandbox_leftovers(e.verifier) == []
    _, reward, done = e.step(turn(ANSWER, index=1))  # the sandbox still serves the episode
    assert done and reward == 1.0


def test_a_tool_call_cannot_read_the_hosts_files(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-OUTPUT-42")
    secret.chmod(0o644)
    e = env()
    if not e.verifier.pool.isolation.private_root:
        pytest.skip("no private root on this machine")
    (m,), _, done = e.step(turn(call(f"print(open({str(secret)!r}).read())")))
    assert not done and "SECRET-OUTPUT-42" not in m["content"] and "FileNotFoundError" in m["content"]


def test_python_tool_is_a_built_in_environment_of_both_algorithms():
    from jaxrl.algorithms import plugins
    assert "python_tool" in plugins.names("environment")
    plugins.check_references({"grpo": {"environment": "python_tool"}, "ppo": {"environment": "python_tool"}})


def test_bad_options_are_refused():
    for options, match in (({"output_chars": 10}, "output_chars"), ({"score": "best"}, "score"),
                           ({"turn_cost": float("nan")}, "turn_cost"), ({"tool_timeout_s": -1}, "tool_timeout_s")):
        with pytest.raises(ValueError, match=f"python_tool: {match}"):
            PythonTool(**options)


# ------------------------------------------------------------------------------------------------ episodes

# ChatML with a tools block in a system turn (what Qwen3.5's template does with `tools`, written small)
TOOLS_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}{{- '\\n</tools><|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}{%- endif -%}")
SCRIPT = [call("print(sum(map(int, '1 2'.split())))", "I will test the parsing first.\n"),
          call("import sys\nprint(7 * 6)\nprint('note', file=sys.stderr)", ""), ANSWER]


class Scripted(RolloutBackend):
    """A policy that writes the hand-written turns of SCRIPT in order (one episode), with made-up log-probs: what
    the runner must carry to the sampled positions."""

    name = "scripted"

    def __init__(self, tok):
        self.tok, self.prompts = tok, []
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def load(self, spec, adapter=None):
        pass

    def close(self):
        pass

    def update_weights(self, policy):
        return None

    def generate(self, prompts, group_ids, sampling):
        assert len(prompts) == 1 and sampling.n == 1
        self.prompts.append(list(prompts[0]))
        t = len(self.prompts) - 1
        ids = list(self.tok(SCRIPT[t], add_special_tokens=False)["input_ids"]) + [self.im_end]
        return [Generation(ids, "stop", 0, 0, [-0.01 * (t + 1)] * len(ids))]


def test_an_episode_of_tool_calls_is_one_exact_token_sequence(tmp_path):
    build_tiny_tokenizer(str(tmp_path), SCRIPT + [SUM.messages[0]["content"], "Traceback ZeroDivisionError"])
    tok = load_tokenizer(str(tmp_path))
    tok.chat_template = TOOLS_TEMPLATE
    backend = Scripted(tok)
    collector = Collector(backend, None, tokenizer=tok, stop_ids=(backend.im_end,))
    runner = EpisodeRunner(collector, PythonTool, tokenizer=tok, enable_thinking=False, max_turns=4,
                           max_new_tokens=128, max_episode_tokens=1024, max_prompt_len=512,
                           options={"workers": 1, "timeout_s": 20.0})
    (e,) = runner.run([SUM], [7], SamplingParams(n=1, max_new_tokens=128, temperature=1.0, seed=3))
    assert e.error is None and e.turns == 3 and e.done and not e.truncated
    assert e.reward == 1.0 and e.solved and e.solved_turn == 3
    # the first prompt: the template's render of the problem with the tool's schema
    assert e.prompt_ids == format_chat(tok, SUM.messages, False, tools=[PYTHON_TOOL])
    assert '"name": "python"' in tok.decode(e.prompt_ids)
    assert [o for o in e.observations] == [[{"role": "tool", "content": "3"}],
                                           [{"role": "tool", "content": "42\nnote"}]]
    # one sequence: each turn's ids as the policy wrote them (mask 1, its log-probs), each tool message as the
    # template's append-only delta (mask 0, log-prob 0); every turn was asked with exactly the history before it
    at = 0
    for t, text in enumerate(SCRIPT):
        assert backend.prompts[t] == e.prompt_ids + e.ids[:at]
        ids = list(tok(text, add_special_tokens=False)["input_ids"]) + [backend.im_end]
        assert e.ids[at:at + len(ids)] == ids and e.mask[at:at + len(ids)] == [1] * len(ids)
        assert e.logprobs[at:at + len(ids)] == [-0.01 * (t + 1)] * len(ids)
        at += len(ids)
        if t < len(e.observations):
            delta = turn_delta_ids(tok, e.observations[t], False, stop_id=backend.im_end)
            assert e.ids[at:at + len(delta)] == delta and e.mask[at:at + len(delta)] == [0] * len(delta)
            assert set(e.logprobs[at:at + len(delta)]) == {0.0}
            at += len(delta)
    assert at == len(e.ids) == len(e.mask) == len(e.logprobs)
    # the reference: ChatML renders history as it was, so the whole episode is the template's render of the
    # conversation (assistant turns opened by the generation prompt's empty think block)
    history = list(SUM.messages)
    for t, text in enumerate(SCRIPT):
        history.append({"role": "assistant", "content": "<think>\n\n</think>\n\n" + text})
        history += e.observations[t] if t < len(e.observations) else []
    full = format_chat(tok, history, False, add_generation_prompt=False, tools=[PYTHON_TOOL])
    assert e.prompt_ids + e.ids == full[:-1]  # the template's last "\n" after <|im_end|> is never sampled
