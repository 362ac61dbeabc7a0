"""The tiny Qwen3.5-style tokenizer, chat formatting with thinking on/off, the prompt budget, completion texts."""

import json
import shutil

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from jaxrl.data.chat import PromptTooLongError, chat_stop_ids, encode_prompts, format_chat, load_tokenizer, \
    render_chat
from jaxrl.generation import completion_texts as decode_texts
from jaxrl.data.tiny_tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer, check_encodable

CORPUS = ["Read two integers a and b from standard input and print a + b.",
          "```python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())))\n```",
          "def solve(nums):\n    return sorted(nums)[::-1]\n", "Count the vowels in a line of text."] * 3
MESSAGES = [{"role": "system", "content": "Answer in python."},
            {"role": "user", "content": "Read two integers and print their sum."}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny_tok"))
    build_tiny_tokenizer(folder, CORPUS, vocab_size=256)
    return folder


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_tiny_tokenizer_layout_and_round_trip(tok_dir, tok):
    assert type(tok).__name__ == "Qwen3_5Tokenizer"
    assert len(tok) <= 256
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 1 and tok.pad_token_id == 0  # = qwen35.tiny()
    text = "Read 12 integers:\n\tprint(a + b)  # sum <think>x</think>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < 256
    assert tok("<|im_start|>user", add_special_tokens=False)["input_ids"][0] == 2  # one token, not split
    raw = Tokenizer.from_file(f"{tok_dir}/tokenizer.json")
    assert raw.encode(text).ids == ids  # the plain tokenizer.json and transformers' Qwen3_5Tokenizer agree
    # In a qwen3_5 model folder transformers builds Qwen3_5Tokenizer with its own pre-tokeniser: still the same.
    model_dir = f"{tok_dir}_model"
    shutil.copytree(tok_dir, model_dir)
    with open(f"{model_dir}/config.json", "w") as f:
        json.dump({"model_type": "qwen3_5"}, f)
    assert AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"] == ids


def test_unencodable_text_is_reported(tok):
    check_encodable(tok, "print(a + b)\n")
    with pytest.raises(ValueError, match="cannot encode"):
        check_encodable(tok, "naïve café")
    with pytest.raises(ValueError, match="vocab_size=40"):
        build_tiny_tokenizer("/nonexistent/never_written", CORPUS, vocab_size=40)


def test_generation_prompts_thinking_on_and_off(tok):
    on = render_chat(tok, MESSAGES, enable_thinking=True)
    off = render_chat(tok, MESSAGES, enable_thinking=False)
    turns = ("<|im_start|>system\nAnswer in python.<|im_end|>\n"
             "<|im_start|>user\nRead two integers and print their sum.<|im_end|>\n")
    assert on == turns + "<|im_start|>assistant\n<think>\n"
    assert off == turns + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render_chat(tok, MESSAGES, enable_thinking=True, add_generation_prompt=False) == turns
    ids = format_chat(tok, MESSAGES, enable_thinking=False)
    assert ids == tok(off, add_special_tokens=False)["input_ids"]
    assert ids[:1] == [2] and 3 in ids and 4 in ids  # <|im_start|>, <think>, </think> as single tokens


def test_prompt_budget_error_or_counted_skip(tok):
    short = [{"role": "user", "content": "Sum."}]
    long = [{"role": "user", "content": "Read two integers and print their sum. " * 20}]
    n_long = len(format_chat(tok, long, True))
    budget = len(format_chat(tok, short, True)) + 5
    enc = encode_prompts(tok, [short, long, short], True, budget, on_overlong="skip")
    assert enc.kept == [0, 2] and enc.skipped == [(1, n_long)] and len(enc.ids) == 2
    with pytest.raises(PromptTooLongError, match=rf"prompt p-long has {n_long} tokens"):
        encode_prompts(tok, [short, long], True, budget, on_overlong="error", names=["p-short", "p-long"])


def test_stop_ids_and_completion_texts(tok):
    assert chat_stop_ids(tok) == (0, 1)  # <|endoftext|>, <|im_end|>
    assert chat_stop_ids(tok, model_eos=(1, 7)) == (0, 1, 7)
    body = tok("<think>\nhmm\n</think>\n\nprint(1)", add_special_tokens=False)["input_ids"]
    texts = decode_texts(tok, [body + [1], body], chat_stop_ids(tok))
    assert texts[0] == "<think>\nhmm\n</think>\n\nprint(1)"  # stop token dropped, think tags kept
    assert texts[1] == texts[0]  # a truncated sample keeps every token it has
