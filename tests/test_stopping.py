"""The stopping rule's host-side pieces that need no model (jaxrl.generation.stopping): what of a running row's text
a stream may send (`StopRule.sure_length`), the cap the context leaves (`max_tokens_within`), and the text of a
token-id completion (`jaxrl.data.token_ids.token_text`, the one helper the engine and the toy rewards share)."""

import ast
import inspect

import pytest

from jaxrl.data.token_ids import token_text
from jaxrl.generation import stopping
from jaxrl.generation.stopping import StopRule, completion_text, max_tokens_within


def rule(*strings: str) -> StopRule:
    return StopRule(stop_ids=(), requested_ids=frozenset(), eos_ids=frozenset(), strings=tuple(strings), one_token={})


@pytest.mark.parametrize("strings,text,sure", [
    ((), "hello", 5),  # no stop strings: all of it
    (("END",), "hello", 3),  # "lo" could still start "END": held back
    (("END",), "hello E", 5),
    (("x", "END"), "abc", 1),  # the longest string decides the holdback
    (("lo", "hel"), "hello", 0),  # the first stop string held: everything before it
    (("llo", "el"), "hello", 1),
    (("END",), "h", -1),  # shorter than the holdback: not even an empty piece
    (("END",), "", -2),
])
def test_sure_length_holds_back_what_could_still_be_a_stop_string(strings, text, sure):
    assert rule(*strings).sure_length(text) == sure


def test_max_tokens_within_the_context():
    assert max_tokens_within(512, 100) == 412
    assert max_tokens_within(512, 512) == 0 and max_tokens_within(100, 512) == 0


def test_token_text_has_one_home_below_generation_and_rewards():
    from jaxrl.rewards import toy
    assert token_text([17, 42, 1]) == "17 42 1" and token_text([]) == ""
    assert toy.token_text is token_text  # still importable where the token task's reward names it
    assert completion_text(None, [17, 42, 1], stop_ids=(1,)) == "17 42"
    imported = {node.module for node in ast.walk(ast.parse(inspect.getsource(stopping)))
                if isinstance(node, ast.ImportFrom)}
    assert not any(m.startswith("jaxrl.rewards") for m in imported), imported
