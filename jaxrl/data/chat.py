"""Chat prompts -> token ids through the model folder's tokenizer and chat template (transformers).

    tok = load_tokenizer(model_dir)                                  # the folder's tokenizer + chat template
    ids = format_chat(tok, messages, enable_thinking=False)          # list[int], ends with the generation prompt
    more = turn_delta_ids(tok, [{"role": "user", "content": "..."}], enable_thinking=False, stop_id=im_end)
                                                                     # an episode's next ids, appended as they are
    enc = encode_prompts(tok, [p["messages"] for p in problems], enable_thinking=True,
                         max_prompt_len=1024, on_overlong="skip")    # enc.ids, enc.kept, enc.skipped

Qwen3.5's generation prompts (docs/design/qwen35-architecture.md §8): thinking on `<|im_start|>assistant\\n<think>\\n`,
off `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`. The template of the folder decides; `enable_thinking`
is passed to it.

Episodes (several turns) grow append-only: `turn_delta_ids` renders new messages after a sampled assistant turn
with the template's own delimiters, never the whole conversation again, because a template may render history
differently from how it was sampled (Qwen3.5 drops the reasoning of assistant turns before the last user message).

Prompts longer than the budget are never cut: `on_overlong="error"` raises naming the prompt, `"skip"` leaves it
out and records (index, length) in `skipped` so callers can count and report it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Optional, Sequence

OVERLONG_POLICIES = ("error", "skip")


class PromptTooLongError(ValueError):
    """A prompt whose token count exceeds the prompt budget (never cut silently)."""


def load_tokenizer(model_dir: str):
    """The tokenizer of an HF model folder (loaded from the folder so transformers picks Qwen3_5Tokenizer)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{model_dir}: the tokenizer has no chat_template (tokenizer_config.json "
                         "`chat_template` or chat_template.jinja); chat prompts cannot be formatted")
    return tok


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], enable_thinking: bool,
                add_generation_prompt: bool = True, tools: Optional[Sequence[Mapping]] = None) -> str:
    """The prompt text the chat template produces (`tools`: OpenAI function tools, for a template that lists them)."""
    extra = {"tools": [dict(t) for t in tools]} if tools else {}
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         enable_thinking=bool(enable_thinking), **extra)


def format_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]], enable_thinking: bool,
                add_generation_prompt: bool = True, tools: Optional[Sequence[Mapping]] = None) -> list[int]:
    """Token ids of the templated conversation (special tokens come from the template text, none added, and never
    from a message's content: `encode_chat`; `tools` as in `render_chat`)."""
    return encode_chat(tokenizer, lambda ms: render_chat(tokenizer, ms, enable_thinking, add_generation_prompt, tools),
                       messages)


# Stands for a message's content when the template is asked where contents go (plain ASCII: no template strips or
# escapes it); {} is the message's index.
_CONTENT_SENTINEL = "JAXRL_MESSAGE_CONTENT_{}_9c2f"


def encode_chat(tokenizer: Any, render: Callable[[list[dict]], str],
                messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of `render(messages)` (a chat template's text) whose control tokens (the tokenizer's added tokens:
    `<|im_start|>`, `<|im_end|>`, `<tool_call>`, `<think>`, ...) come from the template and the assistant's own
    turns alone. Any other message's content is text: a program's output or a problem that prints
    `<|im_end|>\n<|im_start|>user` stays those characters instead of becoming a forged turn. Where no content
    holds such a look-alike the ids are exactly `tokenizer(text)`'s; where one does, the contents are located by a second render with a sentinel in each, and
    the text is split at the template's control tokens only, each run between two encoded as `tokenizer` encodes
    a piece without added tokens (a fast tokenizer splits at added tokens and encodes the pieces apart, so the
    other ids are unchanged). A template that changes a content holding a look-alike (not rendered verbatim) is
    refused (ValueError): it could not be kept text."""
    messages = [dict(m) for m in messages]
    text = render(messages)
    controls = _control_tokens(tokenizer)
    # an assistant turn's control tokens are the model's own (`<think>`, `<tool_call>`): only the other roles' text
    # (user, tool, system: data files, environments, programs) is kept text
    marked = [i for i, m in enumerate(messages)
              if m.get("role") != "assistant" and isinstance(m.get("content"), str) and m["content"]]
    if not any(c in messages[i]["content"] for i in marked for c in controls):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    sentinels = [_CONTENT_SENTINEL.format(i) for i in marked]
    shown = render([dict(m, content=sentinels[marked.index(i)]) if i in marked else m
                    for i, m in enumerate(messages)])
    parts = re.split("|".join(map(re.escape, sentinels)), shown)
    contents = [messages[i]["content"] for i in marked]
    if len(parts) != len(contents) + 1 or "".join(p + c for p, c in zip(parts, contents + [""])) != text:
        raise ValueError("a message's content holds a control token's text and the chat template does not render "
                         "the content verbatim, so it cannot be kept as text")
    spans, at = [], 0
    for part, content in zip(parts, contents):
        spans.append((at + len(part), at + len(part) + len(content)))
        at = spans[-1][1]
    return _encode_split(tokenizer, text, spans, controls)


def _control_tokens(tokenizer: Any) -> dict[str, int]:
    """{text: id} of the tokenizer's added tokens (special or not: `<tool_call>` is an added, non-special token)."""
    return {str(t): int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}


def _encode_split(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]],
                  controls: Mapping[str, int]) -> list[int]:
    """`text` split at the control tokens outside `spans`, each run between two of them encoded without any added
    token (normaliser, pre-tokeniser and model of the fast tokenizer's backend, as `tokenizer(run)` encodes a
    piece that holds none)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("keeping a message's control-token look-alikes as text needs a fast tokenizer "
                         "(tokenizer.json)")
    pattern = re.compile("|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True)))
    ids: list[int] = []
    run: list[str] = []
    edges = [0] + [x for span in spans for x in span] + [len(text)]
    for k in range(len(edges) - 1):
        part = text[edges[k]:edges[k + 1]]
        if k % 2:  # a content span: text, whatever it holds
            run.append(part)
            continue
        last = 0
        for m in pattern.finditer(part):
            run.append(part[last:m.start()])
            ids += _plain_ids(tokenizer, "".join(run)) + [controls[m.group()]]
            run, last = [], m.end()
        run.append(part[last:])
    return ids + _plain_ids(tokenizer, "".join(run))


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
    return [t.id for piece, _ in pieces for t in backend.model.tokenize(piece)]


@dataclasses.dataclass
class EncodedPrompts:
    ids: list[list[int]]  # the kept prompts, in input order
    kept: list[int]  # input index of each kept prompt
    skipped: list[tuple[int, int]]  # (input index, token count) of prompts over the budget


def encode_prompts(tokenizer: Any, conversations: Sequence[Sequence[Mapping[str, str]]], enable_thinking: bool,
                   max_prompt_len: int, on_overlong: str = "error",
                   names: Optional[Sequence[str]] = None) -> EncodedPrompts:
    """Formats and tokenises every conversation; applies the over-budget policy.

    names: optional per-conversation labels (problem ids) used in the error message.
    """
    if on_overlong not in OVERLONG_POLICIES:
        raise ValueError(f"on_overlong must be one of {OVERLONG_POLICIES}, got {on_overlong!r}")
    out = EncodedPrompts([], [], [])
    for i, messages in enumerate(conversations):
        ids = format_chat(tokenizer, messages, enable_thinking)
        if len(ids) > max_prompt_len:
            if on_overlong == "error":
                label = names[i] if names is not None else f"#{i}"
                raise PromptTooLongError(f"prompt {label} has {len(ids)} tokens after the chat template, over "
                                         f"the budget max_prompt_len={max_prompt_len}; raise the budget or "
                                         "skip over-long prompts")
            out.skipped.append((i, len(ids)))
            continue
        out.ids.append(ids)
        out.kept.append(i)
    return out


def chat_stop_ids(tokenizer: Any, model_eos: Optional[int | Sequence[int]] = None) -> tuple[int, ...]:
    """Ids that end an assistant turn: <|im_end|>, the tokenizer's EOS and <|endoftext|>, and the model config's
    eos_token_id (Qwen3.5's generation_config stops on both <|im_end|> and <|endoftext|>)."""
    vocab = tokenizer.get_vocab()
    ids = {int(vocab[t]) for t in ("<|im_end|>", "<|endoftext|>", getattr(tokenizer, "eos_token", None))
           if t is not None and t in vocab}
    if model_eos is not None:
        ids.update([int(model_eos)] if isinstance(model_eos, int) else (int(t) for t in model_eos))
    return tuple(sorted(ids))


# Stands for an assistant turn's content when the template is asked for its delimiters: plain ASCII, so no template
# strips or escapes it, and never tokenised.
_TURN_SENTINEL = "JAXRL_TURN_CONTENT_END_5b1e"


def turn_delta_text(tokenizer: Any, messages: Sequence[Mapping[str, str]], enable_thinking: bool,
                    stop_text: Optional[str] = None) -> str:
    """The template text that follows an assistant turn's sampled content when `messages` come next: the rest of
    the assistant turn (its closing delimiter, less `stop_text` when the model sampled it), the new messages, and
    the generation prompt. Read off one render of [user, assistant(sentinel), *messages], after the sentinel: the
    earlier history is never rendered, so nothing already sampled can change."""
    anchor = [{"role": "user", "content": "."}, {"role": "assistant", "content": _TURN_SENTINEL}]
    text = render_chat(tokenizer, anchor + [dict(m) for m in messages], enable_thinking)
    at = text.rfind(_TURN_SENTINEL)
    if at < 0:
        raise ValueError("the chat template does not render an assistant turn's content verbatim; episodes need "
                         "its turn delimiters (jaxrl.data.chat.turn_delta_text)")
    tail = text[at + len(_TURN_SENTINEL):]
    if stop_text and tail.startswith(stop_text):
        tail = tail[len(stop_text):]  # the model sampled it: it is already in the episode
    return tail


def turn_delta_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]], enable_thinking: bool,
                   stop_id: Optional[int] = None) -> list[int]:
    """Token ids of `turn_delta_text` after a turn that ended with `stop_id` (None: it ended without one). The text
    is tokenised on its own: it follows a special token (the stop id; or, in the template, the turn's closing
    delimiter), and byte-level BPE never merges across a special token, so these are the ids the whole rendered
    conversation would hold at these positions."""
    stop_text = tokenizer.convert_ids_to_tokens(int(stop_id)) if stop_id is not None else None
    # an observation's content is text (encode_chat): a tool's output cannot forge a turn
    return encode_chat(tokenizer, lambda ms: turn_delta_text(tokenizer, ms, enable_thinking, stop_text), messages)
