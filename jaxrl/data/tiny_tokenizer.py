"""A tiny Qwen3.5-style tokenizer, trained offline, for the demo and the tests.

    build_tiny_tokenizer(out_dir, corpus_texts, vocab_size=256)
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)

It is the real tokenizer's pipeline at a tiny size (docs/design/qwen35-architecture.md §8): NFC normaliser, Qwen3.5's
split regex, byte-level BPE without a prefix space, byte-level decoder, so `Qwen3_5Tokenizer` (which transformers
builds for a qwen3_5 model folder, with its own pre-tokeniser) and the plain tokenizer.json encode alike. The
vocabulary is

    0 <|endoftext|>  (pad, unk)     1 <|im_end|>  (eos)     2 <|im_start|>     3 <think>     4 </think>
    then the byte alphabet, then merges, up to vocab_size,

so ids stay below the tiny model's vocab_size (256) and pad/eos agree with `qwen35.tiny()` (pad 0, eos 1).
A byte-level BPE needs 256 byte symbols to encode everything; at vocab_size 256 that does not fit, so the
alphabet is printable ASCII, tab, newline and whatever else the corpus contains. A character outside it cannot be
encoded: `build_tiny_tokenizer` refuses a corpus that would need more symbols than vocab_size, and
`check_encodable` tells callers about text it cannot encode (no silent loss on the corpus it was built for).

The chat template is ChatML with Qwen3.5's generation prompts: thinking on (the default)
`<|im_start|>assistant\\n<think>\\n`, off `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

from jaxrl.utils.io import atomic_write_json

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>", "<think>", "</think>")
# Qwen marks the think tags as ordinary added tokens (kept by decode(skip_special_tokens=True)).
NON_SPECIAL = ("<think>", "</think>")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is not string -%}"
    "{{- raise_exception('chat template: message content must be a string') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def _pretokenize_regex() -> str:
    # The real Qwen3.5 split regex, taken from transformers so both stay identical.
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
    return PRETOKENIZE_REGEX


def _byte_alphabet(corpus: Sequence[str], printable_ascii: bool = True) -> list[str]:
    """The byte-level symbols of every byte of the corpus, and (by default) of printable ASCII, \\t, \\n, \\r."""
    byte_to_symbol = _bytes_to_unicode()
    wanted = (set(range(0x20, 0x7F)) | {0x09, 0x0A, 0x0D}) if printable_ascii else set()
    for text in corpus:
        wanted.update(text.encode("utf-8"))
    return [byte_to_symbol[b] for b in sorted(wanted)]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what ByteLevel uses)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def minimal_vocab_size(corpus_texts: Iterable[str], printable_ascii: bool = True) -> int:
    """The vocab_size at which `build_tiny_tokenizer` learns no merges: one token per byte symbol (plus the
    specials), so every character is its own token."""
    return len(SPECIAL_TOKENS) + len(_byte_alphabet([str(t) for t in corpus_texts], printable_ascii))


def build_tiny_tokenizer(out_dir: str, corpus_texts: Iterable[str], vocab_size: int = 256,
                         model_max_length: int = 4096, printable_ascii: bool = True) -> str:
    """Trains the tokenizer on `corpus_texts` and writes an HF tokenizer folder; returns out_dir.

    printable_ascii=False: only the corpus's own bytes are symbols (a text outside it cannot be encoded); the
    demo uses it so a tiny model's vocabulary holds nothing but the characters its task is about.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    corpus = [str(t) for t in corpus_texts]
    alphabet = _byte_alphabet(corpus, printable_ascii)
    needed = len(SPECIAL_TOKENS) + len(alphabet)
    if needed > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} cannot hold the {len(SPECIAL_TOKENS)} special tokens and the "
                         f"{len(alphabet)} byte symbols this corpus needs; raise vocab_size or use ASCII text")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_pretokenize_regex()), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False, min_frequency=2)
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"trained vocabulary has {tok.get_vocab_size()} entries, over vocab_size={vocab_size}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    with open(path) as f:
        data = json.load(f)
    for entry in data["added_tokens"]:
        if entry["content"] in NON_SPECIAL:
            entry["special"] = False
    atomic_write_json(path, data)
    config = {
        "tokenizer_class": "Qwen3_5Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "bos_token": None,
        "add_prefix_space": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    atomic_write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
    return out_dir


def check_encodable(tokenizer, text: str) -> None:
    """Raises ValueError if `text` does not survive encode -> decode (characters outside the alphabet)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    back = tokenizer.decode(ids, skip_special_tokens=False)
    if back != text:
        first = next((i for i, (a, b) in enumerate(zip(back, text)) if a != b), min(len(back), len(text)))
        raise ValueError(f"the tokenizer cannot encode this text faithfully (first difference at character "
                         f"{first}: {text[first:first + 20]!r})")

