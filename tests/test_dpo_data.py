"""DPO sequences: chat template + completion + turn end, completion-only loss masks, the max_length policies and
their counts, pre-tokenised pairs, the held-out split."""

import numpy as np
import pytest

from jaxrl.data import dpo_data
from jaxrl.data.dpo_data import EncodedPair, SequenceConfig, build_sequences
from jaxrl.data.pairs import pair_id
from jaxrl.data.chat import format_chat, load_tokenizer
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer

CORPUS = ["Read two integers a and b from standard input and print a + b.",
          "```python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())))\n```",
          "def solve(nums):\n    return sorted(nums)[::-1]\n", "Count the vowels in a line of text."] * 3
MESSAGES = [{"role": "system", "content": "Answer in python."},
            {"role": "user", "content": "Read two integers and print their sum."}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny_tok"))
    build_tiny_tokenizer(folder, CORPUS, vocab_size=256)
    return load_tokenizer(folder)


def text_pair(chosen="print(sum(map(int, input().split())))", rejected="print(a - b)", **extra):
    return {"problem_id": "p1", "messages": MESSAGES, "chosen": chosen, "rejected": rejected,
            "chosen_reward": 1.0, "rejected_reward": 0.0, "chosen_tokens": 10, "rejected_tokens": 5, **extra}


@pytest.mark.parametrize("thinking", [False, True])
def test_text_pair_is_template_plus_completion_plus_turn_end(tok, thinking):
    enc = dpo_data.tokenize_pairs([text_pair()], tok, enable_thinking=thinking)
    prompt = format_chat(tok, MESSAGES, thinking, add_generation_prompt=True)
    gen_prompt = "<|im_start|>assistant\n<think>\n" + ("" if thinking else "\n</think>\n\n")
    assert tok.decode(prompt).endswith(gen_prompt)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end == 1
    chosen = tok("print(sum(map(int, input().split())))", add_special_tokens=False)["input_ids"]
    rejected = tok("print(a - b)", add_special_tokens=False)["input_ids"]
    (pair,) = enc
    assert list(pair.prompt_ids) == prompt
    assert list(pair.chosen_ids) == chosen + [end] and list(pair.rejected_ids) == rejected + [end]

    data = build_sequences(enc, SequenceConfig(max_length=512, pad_multiple=64, pad_id=0))
    P, T = len(prompt), data.arrays["chosen_input_ids"].shape[1]
    assert T == 64 * -(-(P + len(chosen) + 1) // 64)  # the longest sequence rounded up to the bucket
    for side, comp in (("chosen", chosen + [end]), ("rejected", rejected + [end])):
        ids, attn, loss = (data.arrays[f"{side}_{k}"][0] for k in ("input_ids", "attention_mask", "loss_mask"))
        n = P + len(comp)
        assert list(ids[:n]) == prompt + comp and not ids[n:].any()  # right padding with pad id 0
        assert attn.tolist() == [1] * n + [0] * (T - n)
        assert loss.tolist() == [0] * P + [1] * len(comp) + [0] * (T - n)  # completion + turn end only
    assert data.pair_ids == [pair_id("p1", text_pair()["chosen"], text_pair()["rejected"])]


def test_capped_completion_gets_no_turn_end_and_messages_come_from_problems(tok):
    pair = text_pair(messages=None, chosen_finish_reason="stop", rejected_finish_reason="length")
    with pytest.raises(ValueError, match="data.problems"):
        dpo_data.tokenize_pairs([pair], tok, enable_thinking=False)
    (enc,) = dpo_data.tokenize_pairs([pair], tok, enable_thinking=False, messages_by_problem={"p1": MESSAGES})
    assert list(enc.prompt_ids) == format_chat(tok, MESSAGES, False)
    assert enc.chosen_ids[-1] == 1
    assert list(enc.rejected_ids) == tok("print(a - b)", add_special_tokens=False)["input_ids"]  # cut by the cap


def _pair(pid, prompt_len, chosen_len, rejected_len):
    # distinct, recognisable ids: prompt 100+i, chosen 200+i, rejected 300+i
    return EncodedPair(pid, tuple(100 + i for i in range(prompt_len)), tuple(200 + i for i in range(chosen_len)),
                       tuple(300 + i for i in range(rejected_len)))


def test_truncate_prompt_cuts_from_the_left_and_never_the_completion():
    pairs = [_pair("fits", 10, 6, 4),            # 16 <= 20
             _pair("cut", 30, 8, 12),            # 42 > 20: prompt keeps its last 20 - 12 = 8 tokens
             _pair("too_long", 5, 18, 3),        # 18 + min_prompt_tokens 4 > 20: dropped, completion intact nowhere
             _pair("edge", 16, 4, 2),            # exactly 20: kept as is
             _pair("empty", 3, 0, 2)]
    data = build_sequences(pairs, SequenceConfig(max_length=20, overlong="truncate_prompt", min_prompt_tokens=4,
                                                 pad_multiple=8))
    s = data.stats
    assert (s["input_pairs"], s["kept"], s["prompt_truncated"], s["dropped_completion_overlong"],
            s["dropped_overlong"], s["dropped_empty"], s["dropped"]) == (5, 3, 1, 1, 0, 1, 2)
    assert s["prompt_tokens_cut"] == 22 and s["dropped_pair_ids"] == {"dropped_completion_overlong": ["too_long"],
                                                                      "dropped_empty": ["empty"]}
    assert data.pair_ids == ["fits", "cut", "edge"]
    assert data.arrays["chosen_input_ids"].shape == (3, 20)  # bucket 24 capped at max_length
    row = data.pair_ids.index("cut")
    for side, base, n in (("chosen", 200, 8), ("rejected", 300, 12)):
        ids = data.arrays[f"{side}_input_ids"][row]
        loss = data.arrays[f"{side}_loss_mask"][row]
        assert list(ids[:8]) == list(range(122, 130))  # the prompt's last 8 tokens (its end survives)
        assert list(ids[8:8 + n]) == list(range(base, base + n))  # the whole completion
        assert loss.sum() == n and loss[8:8 + n].all()


def test_drop_policy_and_prompt_budget():
    pairs = [_pair("fits", 10, 6, 4), _pair("cut", 30, 8, 12), _pair("long_prompt", 14, 2, 2)]
    drop = build_sequences(pairs, SequenceConfig(max_length=20, overlong="drop", pad_multiple=8))
    assert drop.pair_ids == ["fits", "long_prompt"]
    assert (drop.stats["dropped_overlong"], drop.stats["prompt_truncated"], drop.stats["kept"]) == (1, 0, 2)
    assert drop.arrays["chosen_input_ids"].shape == (2, 16)  # longest 16, bucket 8
    # a prompt budget: truncate_prompt cuts the 14-token prompt to 12; drop drops it
    cut = build_sequences(pairs, SequenceConfig(max_length=20, max_prompt_length=12, pad_multiple=1))
    row = cut.pair_ids.index("long_prompt")
    assert cut.arrays["chosen_attention_mask"][row].sum() == 14
    assert list(cut.arrays["chosen_input_ids"][row][:12]) == list(range(102, 114))
    assert cut.stats["prompt_truncated"] == 2 and cut.stats["prompt_tokens_cut"] == 2 + 22
    drop = build_sequences(pairs, SequenceConfig(max_length=20, max_prompt_length=12, overlong="drop"))
    assert drop.pair_ids == ["fits"] and drop.stats["dropped_overlong"] == 2
    with pytest.raises(ValueError, match="no pair survives"):
        build_sequences(pairs[1:2], SequenceConfig(max_length=8, overlong="drop"))
    with pytest.raises(ValueError, match="data.overlong"):
        SequenceConfig(overlong="cut_completion")
    with pytest.raises(ValueError, match="data.min_prompt_tokens"):
        SequenceConfig(min_prompt_tokens=0)


def test_pretokenized_pairs_are_used_verbatim_and_validated():
    recs = [{"pair_id": "a", "prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 1], "rejected_ids": [4, 1]},
            {"prompt_ids": [5], "chosen_ids": [8], "rejected_ids": [9, 9, 9]}]
    enc = dpo_data.pretokenized_pairs(recs)
    assert [e.pair_id for e in enc] == ["a", "1"]
    data = build_sequences(enc, SequenceConfig(max_length=16, pad_multiple=4, pad_id=0))
    assert data.arrays["chosen_input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 0, 0], [5, 8, 0, 0, 0, 0, 0, 0]]
    assert data.arrays["rejected_loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="record 0.*chosen_ids"):
        dpo_data.pretokenized_pairs([{"prompt_ids": [1], "chosen_ids": "abc", "rejected_ids": [2]}])
    with pytest.raises(ValueError, match="record 0.*rejected_ids"):
        dpo_data.pretokenized_pairs([{"prompt_ids": [1], "chosen_ids": [3]}])


def test_digest_split_and_synthetic_pairs():
    recs = dpo_data.synthetic_pairs(40, vocab_size=256, seed=3, prompt_len=5, completion_len=3, num_tokens=32)
    assert recs == dpo_data.synthetic_pairs(40, vocab_size=256, seed=3, prompt_len=5, completion_len=3,
                                            num_tokens=32)
    for r in recs:
        seq = r["prompt_ids"] + r["chosen_ids"][:-1]
        assert all(2 <= t < 34 for t in seq + r["rejected_ids"][:-1])
        assert all((b - a) % 32 == 1 for a, b in zip(seq, seq[1:]))  # the progression continues in chosen
        assert r["chosen_ids"][-1] == r["rejected_ids"][-1] == 1  # both end with eos
        assert all(x != y for x, y in zip(r["rejected_ids"][:-1], r["chosen_ids"][:-1]))  # every step breaks it
    data = build_sequences(dpo_data.pretokenized_pairs(recs), SequenceConfig(max_length=64, pad_multiple=8))
    changed = build_sequences(dpo_data.pretokenized_pairs(recs[:-1] + [dict(recs[-1], rejected_ids=[2, 3, 4, 1])]),
                              SequenceConfig(max_length=64, pad_multiple=8))
    assert data.digest() == build_sequences(dpo_data.pretokenized_pairs(recs),
                                            SequenceConfig(max_length=64, pad_multiple=8)).digest()
    assert data.digest() != changed.digest()
    train, held = dpo_data.split_eval(data.pair_ids, 0.25, seed=0)
    assert len(held) == 10 and len(train) == 30 and not set(train) & set(held)
    # the held-out choice follows the pair ids, not the file order
    rev = list(reversed(data.pair_ids))
    _, held_rev = dpo_data.split_eval(rev, 0.25, seed=0)
    assert sorted(rev[i] for i in held_rev) == sorted(data.pair_ids[i] for i in held)
    assert sorted(dpo_data.split_eval(data.pair_ids, 0.25, seed=1)[1].tolist()) != sorted(held.tolist())
    with pytest.raises(ValueError, match="data.eval_fraction"):
        dpo_data.split_eval(data.pair_ids, 1.0, seed=0)
