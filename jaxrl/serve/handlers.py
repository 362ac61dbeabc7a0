"""What the server answers to completions and chat requests: the prompts' token ids, the rows a request asks for
(one `jaxrl.generation.Request` each), the stopping rule applied to every finished row
(`jaxrl.generation.stopping.StopRule`), the log-prob entries, and the response, whole or streamed.

Semantics as vLLM's: `stop` strings are matched on the decoded text and left out of it (finish_reason "stop",
stop_reason the string); a stop id is kept in token_ids, left out of the text, and named in stop_reason unless it
is an EOS id. Log-probs are at temperature 1 and unfiltered (vLLM's raw_logprobs): with `logprobs: 0` the
sampler's own, with k > 0 or `echo` the teacher-forced pass of the trainer over prompt + completion (a top-k dict
holds the k most likely tokens and the token itself). `prompt_logprobs: k` (vLLM's extension field) gives each choice
vLLM's `prompt_logprobs`: per prompt token a dict {token id: {logprob, rank, decoded_token}} of the token itself (its
rank among the vocabulary, 1 = most likely) and the k most likely (ranks 1..k), the first entry null, a -inf
log-prob as -9999.0 (vllm/entrypoints/openai/completion/serving.py:580-642, vllm/logprobs.py:165-209,
vllm/entrypoints/generate/base/serving.py:381-393). k is bounded by --max_logprobs, 20 by default as vLLM's
(-1: the vocabulary). `usage` is in every response. `stream` sends a completion's
chunks as the rows are sampled (`live_response`: each row's new text at every round end, held back where it could
be the start of a stop string), or, with log-probs or echo (or tools), one chunk per token once it is done.

Off the event loop: everything a request costs in CPU (parsing and validating its body, tokenising its prompts and
stop strings, detokenising the rows, building log-prob entries, encoding the JSON) runs in worker threads
(`asyncio.to_thread`, a streamed response's chunks in Starlette's thread pool), one choice at a time, so `/health`
and the other requests keep being answered while one large request is prepared or answered. A client that
disconnects while its rows are generated or scored has its request cancelled (`ServeLoop.cancel`): its rows
leave the engine at the next round end.

Seeds: choice i of a request with seed R is sampled with the key of `split_request_seed(R + i)` = (seed, group id,
sample index) (`jaxrl.generation.sampling`), as vLLM seeds choice i with R + i; a request without a seed gets a
random group id under the server's own seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets
from typing import Optional, Sequence

from fastapi.responses import Response, StreamingResponse

from jaxrl.data.chat import chat_stop_ids, render_chat
from jaxrl.generation.engine import Cancelled, Request
from jaxrl.generation.sampling import SEED_BITS, request_seed, split_request_seed
from jaxrl.generation.stopping import Finished, StopRule, max_tokens_within
from jaxrl.serve.loop import Overloaded, ServeLoop, ShuttingDown
from jaxrl.data.tool_calls import parse_tool_calls
from jaxrl.serve.protocol import (MAX_SEED, ApiError, ChatCompletionRequest, CompletionRequest, check_tools, new_id,
                                  now, refuse_unsupported, sse, stop_strings, template_message, usage)
from jaxrl.serve.registry import AdapterRegistry, Served
from jaxrl.serve.settings import ServeLimits
from jaxrl.serve.text import clip_pieces, token_pieces, token_strings

NORMALISATION_SLACK = 4  # a text prompt may shrink this much in characters under Unicode normalisation


class Handlers:
    """Completions and chat over a serve loop (module docstring)."""

    def __init__(self, tokenizer, registry: AdapterRegistry, loop: ServeLoop, limits: ServeLimits, *,
                 eos_ids: Sequence[int], vocab_size: int):
        self.tokenizer, self.registry, self.loop, self.limits = tokenizer, registry, loop, limits
        self.eos_ids = tuple(eos_ids)
        self.chat_stop_ids = chat_stop_ids(tokenizer, list(eos_ids))
        self.vocab_size = int(vocab_size)
        # vLLM's --max-logprobs: -1 = the whole vocabulary (vllm/sampling_params.py:922-981)
        self.max_logprobs = self.vocab_size if limits.max_logprobs == -1 else int(limits.max_logprobs)
        self.max_model_len, self.max_prompt_len = limits.max_model_len, limits.max_prompt_len
        # the most characters one token stands for: a text longer than max_prompt_len of them (with slack for
        # normalisation) has more than max_prompt_len tokens, whatever they are
        self.max_token_chars = max(len(t) for t in tokenizer.get_vocab())
        self.server_seed = secrets.randbelow(2 ** SEED_BITS)  # unseeded requests: random group ids under it

    # ---------------------------------------------------------------------------------------------- prompts
    def encode_text(self, text: str, what: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt; a text too long to fit max_prompt_len tokens is refused before tokenizing."""
        if len(text) > NORMALISATION_SLACK * self.max_token_chars * self.max_prompt_len:
            raise ApiError(f"{what} has {len(text)} characters: more than {self.max_prompt_len} tokens (this "
                           f"server's max_prompt_len) could hold", param="prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def prompt_ids(self, prompt) -> tuple[list[list[int]], list[Optional[str]]]:
        """(token ids, text or None) of each prompt of a completions request."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise ApiError("prompt is empty", param="prompt")
        if len(prompt) > self.limits.max_prompts:
            raise ApiError(f"{len(prompt)} prompts in one request; at most {self.limits.max_prompts}",
                           param="prompt")
        ids, texts = [], []
        for j, p in enumerate(prompt):
            if isinstance(p, str):
                texts.append(p)
                p = self.encode_text(p, f"prompt {j}")
            else:
                texts.append(None)
            if not p:
                raise ApiError(f"prompt {j} is empty", param="prompt")
            ids.append(self.check_prompt(p, j))
        return ids, texts

    def check_prompt(self, ids: Sequence[int], j: int = 0) -> list[int]:
        if len(ids) > self.max_prompt_len:
            raise ApiError(f"prompt {j} has {len(ids)} tokens, over this server's max_prompt_len "
                           f"{self.max_prompt_len} (launchers.serve --max_prompt_len)", param="prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ApiError(f"prompt {j} has token ids outside [0, {self.vocab_size})", param="prompt")
        return [int(t) for t in ids]

    def max_tokens(self, requested: Optional[int], prompts: list[list[int]], field: str = "max_tokens") -> int:
        """The completion cap: as requested (None: the rest of the context, as vLLM), within max_model_len."""
        longest = max(len(p) for p in prompts)
        if requested is None:
            return max_tokens_within(self.max_model_len, longest)
        if longest + int(requested) > self.max_model_len:
            raise ApiError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {longest + int(requested)} tokens ({longest} in the prompt, {int(requested)} "
                           f"in the completion). Please reduce the prompt or {field}.", param=field)
        return int(requested)

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [template_message(m) for m in req.messages]
        kwargs = req.chat_template_kwargs or {}
        text = render_chat(self.tokenizer, messages, bool(kwargs.get("enable_thinking", False)),
                           req.add_generation_prompt, tools=req.tools)
        return self.check_prompt(self.encode_text(text, "the templated conversation", add_special_tokens=False))

    # -------------------------------------------------------------------------------------------- generation
    def stop_rule(self, req, default_ids: Sequence[int]) -> StopRule:
        requested = [int(t) for t in (req.stop_token_ids or [])]
        bad = [t for t in requested if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(f"stop_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids")
        return StopRule.of_request(self.tokenizer, eos_ids=self.eos_ids, stop_token_ids=requested,
                                   strings=stop_strings(req.stop), ignore_eos=req.ignore_eos, default_ids=default_ids,
                                   include_stop_str=req.include_stop_str_in_output)

    def _check_counts(self, req, prompts: list) -> None:
        if req.n > self.limits.max_n:
            raise ApiError(f"n={req.n} is over this server's bound {self.limits.max_n} (launchers.serve --max_n)",
                           param="n")
        if len(prompts) * req.n > self.limits.max_pending_rows:
            raise ApiError(f"{len(prompts)} prompts x n={req.n} rows exceed what this server queues "
                           f"({self.limits.max_pending_rows})", param="n")

    def rows(self, req, prompts: list[list[int]], max_tokens: int, rule: StopRule, progress=None) -> list[Request]:
        """The rows of a request, prompt-major (n per prompt), each keyed by its seed (module docstring);
        `progress(row, tokens)` gets each row's tokens at every round end (a live stream)."""
        seed = req.seed if req.seed not in (None, -1) else request_seed(self.server_seed, secrets.randbits(32))
        if int(seed) + req.n - 1 >= MAX_SEED:  # choice i is seeded seed + i, which must stay an int64
            raise ApiError(f"seed {seed} + n - 1 is over {MAX_SEED - 1} (choice i is sampled with seed + i)",
                           param="seed")
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        top_k = 0 if req.top_k in (None, -1) else int(req.top_k)
        out = []
        for p in prompts:
            for i in range(req.n):
                s, group, sample = split_request_seed(int(seed) + i)
                watch = None if progress is None else functools.partial(progress, len(out))
                out.append(Request(p, group_id=group, sample_index=sample, seed=s, max_new_tokens=max_tokens,
                                   on_tokens=watch,
                                   temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=rule.stop_ids))
        return out

    def check_response_size(self, req, prompts: list[list[int]], max_tokens: int, echo: bool, top_k: int,
                            logprobs: bool, prompt_k: Optional[int] = None) -> None:
        """Refuses up front a response over `max_response_entries`: every returned token counts once, and as many
        more as it carries log-prob entries (its own and its top k; `prompt_k`: each choice's prompt_logprobs)."""
        per_token = 1 + (1 + top_k if logprobs else 0)
        tokens = sum(req.n * (max_tokens + (len(p) if echo else 0)) for p in prompts)
        need = tokens * per_token
        if prompt_k is not None:
            tokens += sum(req.n * len(p) for p in prompts)
            need += sum(req.n * len(p) * (1 + prompt_k) for p in prompts)
        if need > self.limits.max_response_entries:
            raise ApiError(f"this request could return {need} entries ({tokens} tokens x {per_token} each: the token"
                           f"{' and its log-prob entries' if logprobs else ''}), over this server's bound of "
                           f"{self.limits.max_response_entries} (launchers.serve --max_response_entries); ask for "
                           "fewer rows, tokens or log-probs per request", param="max_tokens")

    async def wait(self, future, client) -> list:
        """The result of a serve-loop future. `client` (the HTTP request, or None) is watched meanwhile: when it
        disconnects first, the request is cancelled (`ServeLoop.cancel`) and `ClientGone` raised. Server-side
        refusals (overloaded, shutting down) are HTTP 503."""
        waiter = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(client_gone(client)) if client is not None else None
        try:
            if gone is None:
                return await waiter
            done, _ = await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if waiter in done:
                return waiter.result()
            self.loop.cancel(future)
            raise ClientGone("the client disconnected")
        except asyncio.CancelledError:  # the server stops the task (shutdown past its grace period)
            self.loop.cancel(future)
            raise
        except (Overloaded, ShuttingDown) as e:
            raise ApiError(str(e), 503) from None
        except Cancelled:
            raise ClientGone("the client disconnected") from None
        finally:
            if gone is not None:
                gone.cancel()

    async def generate(self, served: Served, rows: list[Request], client, partial: bool = False) -> list:
        """The engine's completions of a request's rows (in order); partial: `ServeLoop.generate`'s."""
        if not rows:
            return []
        try:
            future = self.loop.generate(served.name, rows, partial=partial)
        except (Overloaded, ShuttingDown) as e:
            raise ApiError(str(e), 503) from None
        return await self.wait(future, client)

    async def score(self, served: Served, sequences: list[list[int]], top_k: int, client=None) -> list:
        try:
            future = self.loop.score(served.name, sequences, top_k)
        except (Overloaded, ShuttingDown) as e:
            raise ApiError(str(e), 503) from None
        return await self.wait(future, client)

    def token_versions(self, req, completions: list, choices: list[Finished]) -> Optional[list[dict]]:
        """Per choice {"token_versions": [index per token], "version_digests": [digest]} (the extension fields)
        when the request asks for them (return_token_versions or partial_rollout), else None. A token's version is
        the adapter digest the server held for its model when it sampled that token (null: the base)."""
        if not (req.return_token_versions or req.partial_rollout):
            return None
        out = []
        for k, c in enumerate(choices):
            versions = completions[k].token_versions[:len(c.tokens)] if completions else []
            index: dict = {}  # engine version -> its index in this choice's digests, in order of first use
            for v in versions:
                index.setdefault(int(v), len(index))
            digests = [self.loop.digest_of(v) for v in index]
            out.append({"token_versions": [index[int(v)] for v in versions], "version_digests": digests})
        return out

    def finished(self, req, rule: StopRule, completions: list, count: int) -> list[Finished]:
        """The rows as the client sees them (the stopping rule applied); `count` empty rows at max_tokens 0."""
        if not completions:
            return [Finished([], [], "", "length", None) for _ in range(count)]
        return [rule.finish(self.tokenizer, c.tokens, [float(x) for x in c.logprobs], c.finish_reason,
                            req.skip_special_tokens) for c in completions]

    # ------------------------------------------------------------------------------------------- completions
    def _logprob_entries(self, ids: Sequence[int], values: Sequence, top_ids, top_values, as_ids: bool) -> tuple:
        """(token strings, token log-probs, top-log-prob dicts) of tokens whose scores are given."""
        strings = token_strings(self.tokenizer, ids, as_ids)
        tops = []
        for k, (t, v) in enumerate(zip(ids, values)):
            if top_ids is None:
                tops.append({strings[k]: float(v)})
                continue
            entry: dict = {}
            for s, x in zip(token_strings(self.tokenizer, top_ids[k], as_ids), top_values[k]):
                entry.setdefault(s, float(x))  # two ids of one text: the likelier one's value (greedy checks)
            entry.setdefault(strings[k], float(v))  # the token itself, as vLLM, when outside the top k
            tops.append(entry)
        return strings, [float(v) for v in values], tops

    def plan_completion(self, req: CompletionRequest, progress=None) -> "Plan":
        """Everything checked and prepared before a completions request's rows go to the engine (a worker thread:
        tokenising)."""
        refuse_unsupported(req)
        served = self.registry.served(req.model)
        if req.logprobs is not None and req.logprobs > self.max_logprobs:
            raise ApiError(f"logprobs={req.logprobs} is over this server's bound {self.max_logprobs} "
                           f"(launchers.serve --max_logprobs)", param="logprobs")
        prompt_k = self.prompt_logprobs_k(req)
        prompts, texts = self.prompt_ids(req.prompt)
        self._check_counts(req, prompts)
        max_tokens = self.max_tokens(req.max_tokens, prompts)
        if req.stream and req.echo and req.n > 1:
            raise ApiError("echo with stream and n > 1 is not supported", param="echo")
        self.check_response_size(req, prompts, max_tokens, req.echo, req.logprobs or 0, req.logprobs is not None,
                                 prompt_k)
        rule = self.stop_rule(req, ())
        rows = self.rows(req, prompts, max_tokens, rule, progress) if max_tokens else []
        return Plan(served, prompts, texts, rule, rows)

    def prompt_logprobs_k(self, req: CompletionRequest) -> Optional[int]:
        """The k of vLLM's `prompt_logprobs` (None: not asked), checked as vLLM checks it, with its messages
        (vllm/entrypoints/openai/completion/protocol.py:573-587, vllm/sampling_params.py:972-981)."""
        k = req.prompt_logprobs
        if k is None:
            return None
        if k < 0 and k != -1:
            raise ApiError("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
        if req.stream:  # vLLM's refusal for k != 0; this server streams no prompt_logprobs at all (k = 0 too)
            raise ApiError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        k = self.vocab_size if k == -1 else int(k)
        if k > self.max_logprobs:
            raise ApiError(f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                           f"{self.max_logprobs} (launchers.serve --max_logprobs)", param="prompt_logprobs")
        return k

    async def completions(self, req: CompletionRequest, client=None):
        if req.stream and req.logprobs is None and not req.echo:  # token by token as the rows are sampled
            live = LiveRows()
            plan = await asyncio.to_thread(self.plan_completion, req, live.progress)
            return self.live_response(req, plan, live, chat=False)
        plan = await asyncio.to_thread(self.plan_completion, req)
        completions = await self.generate(plan.served, plan.rows, client, req.partial_rollout)
        choices = await asyncio.to_thread(self.finished, req, plan.rule, completions, len(plan.prompts) * req.n)
        of_choice = [k // req.n for k in range(len(choices))]  # choice -> its prompt
        k = req.logprobs
        prompt_k = self.prompt_logprobs_k(req)
        scores = None
        if (k is not None and (req.echo or k > 0)) or prompt_k is not None:
            # teacher-forced: the prompt's log-probs, every token's top k (at least 1: prompt_logprobs' ranks)
            top = max(k or 0, prompt_k or 0, 1 if prompt_k is not None else 0)
            scores = await self.score(plan.served, [plan.prompts[j] + c.tokens for j, c in zip(of_choice, choices)],
                                      top, client)
        body = await asyncio.to_thread(lambda: self._completion_body(req, plan, choices, of_choice, scores,
                                                                     self.token_versions(req, completions, choices)))
        if req.stream:
            return StreamingResponse(self._stream_completion(req, body, choices, [plan.prompts[j] for j in of_choice]),
                                     media_type="text/event-stream")
        return await json_response(body)

    def _completion_body(self, req, plan: "Plan", choices: list[Finished], of_choice: list[int], scores,
                         versions: Optional[list] = None) -> dict:
        out = []
        k = req.logprobs
        for idx, (j, c) in enumerate(zip(of_choice, choices)):
            p = plan.prompts[j]
            prompt_text = (plan.texts[j] if plan.texts[j] is not None else
                           self.tokenizer.decode(p, skip_special_tokens=False)) if req.echo else ""
            choice = {"index": idx, "text": prompt_text + c.text, "logprobs": None, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if k is not None:
                choice["logprobs"] = self._completion_logprobs(req, p, c, scores[idx] if scores else None)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(p, scores[idx], self.prompt_logprobs_k(req))
            if req.return_token_ids:
                choice["token_ids"] = list(c.tokens)
                choice["prompt_token_ids"] = list(p)
            if versions is not None:
                choice.update(versions[idx])
            out.append(choice)
        return {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": plan.served.name,
                "choices": out, "usage": usage(sum(len(p) for p in plan.prompts), sum(len(c.tokens) for c in choices))}

    def _completion_logprobs(self, req, prompt: list, c: Finished, score) -> dict:
        as_ids = req.return_tokens_as_token_ids
        if score is None:  # logprobs=0 without echo: the sampler's log-prob of each sampled token
            strings, values, tops = self._logprob_entries(c.tokens, c.logprobs, None, None, as_ids)
        else:
            start = 0 if req.echo else len(prompt) - 1  # score position t-1 holds token t
            ids = (prompt + c.tokens)[start + 1:] if not req.echo else (prompt + c.tokens)[1:]
            values = score.logprobs[start:]
            k = req.logprobs or 0  # the score may hold more (prompt_logprobs' k): the first k are the top k
            top_ids = score.top_ids[start:, :k] if k else None
            strings, values, tops = self._logprob_entries(ids, values, top_ids, score.top_logprobs[start:, :k],
                                                          as_ids)
            if req.echo:  # the first prompt token has no log-prob
                strings = token_strings(self.tokenizer, prompt[:1], as_ids) + strings
                values, tops = [None] + values, [None] + tops
        if not req.logprobs and score is not None:
            tops = [None if t is None else {s: v} for t, s, v in zip(tops, strings, values)]
        pieces = (token_pieces(self.tokenizer, prompt, False) if req.echo else []) + token_pieces(
            self.tokenizer, c.tokens, req.skip_special_tokens)
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": strings, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_logprobs(self, prompt: list, score, k: int) -> list:
        """vLLM's prompt_logprobs of a prompt (module docstring): entry j (j >= 1) holds token j's own entry first
        and then the top k, one dict, so a token inside the top k appears once, at its own place with its top-k
        rank, as vLLM's dict comprehension leaves it (vllm/logprobs.py:189-209)."""
        out: list = [None]
        for j, token in enumerate(prompt[1:]):  # score position j holds the log-probs of token j + 1
            ids = [int(token)] + [int(t) for t in score.top_ids[j, :k]]
            values = [float(score.logprobs[j])] + [float(v) for v in score.top_logprobs[j, :k]]
            ranks = [int(score.ranks[j])] + list(range(1, k + 1))
            entry = {}
            for t, v, r, text in zip(ids, values, ranks, token_strings(self.tokenizer, ids)):
                entry[str(t)] = {"logprob": -9999.0 if v == float("-inf") else v, "rank": r, "decoded_token": text}
            out.append(entry)
        return out

    def _stream_completion(self, req, body: dict, choices: list[Finished], prompts: list):
        head = {k: body[k] for k in ("id", "object", "created", "model")}
        for idx, c in enumerate(choices):
            full = body["choices"][idx]
            lp = full["logprobs"]
            echo_len = len(prompts[idx]) if req.echo else 0
            if req.echo:
                prompt_text = full["text"][:len(full["text"]) - len(c.text)]
                chunk_lp = None if lp is None else {key: lp[key][:echo_len] for key in lp}
                yield sse({**head, "choices": [{"index": idx, "text": prompt_text, "logprobs": chunk_lp,
                                                "finish_reason": None, "stop_reason": None}]})
            for k, piece in enumerate(clip_pieces(token_pieces(self.tokenizer, c.tokens, req.skip_special_tokens),
                                                  c.text)):
                chunk_lp = None if lp is None else {key: lp[key][echo_len + k:echo_len + k + 1] for key in lp}
                yield sse({**head, "choices": [{"index": idx, "text": piece, "logprobs": chunk_lp,
                                                "finish_reason": None, "stop_reason": None}]})
            yield sse({**head, "choices": [{"index": idx, "text": "", "logprobs": None,
                                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": body["usage"]})
        yield sse("[DONE]")

    # -------------------------------------------------------------------------------------------------- chat
    def plan_chat(self, req: ChatCompletionRequest, progress=None) -> "Plan":
        """A chat request checked and prepared (a worker thread: the chat template, tokenising)."""
        refuse_unsupported(req)
        if req.echo:
            raise ApiError("echo is not supported for chat completions (use /v1/completions with echo)",
                           param="echo")
        served = self.registry.served(req.model)
        check_tools(req.tools)
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        if top > self.max_logprobs:
            raise ApiError(f"top_logprobs={top} is over this server's bound {self.max_logprobs}",
                           param="top_logprobs")
        prompt = self.chat_prompt(req)
        self._check_counts(req, [prompt])
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(req.max_completion_tokens if req.max_completion_tokens is not None
                                     else req.max_tokens, [prompt], field)
        self.check_response_size(req, [prompt], max_tokens, False, top, bool(req.logprobs))
        rule = self.stop_rule(req, self.chat_stop_ids)
        rows = self.rows(req, [prompt], max_tokens, rule, progress) if max_tokens else []
        return Plan(served, [prompt], [None], rule, rows)

    async def chat_completions(self, req: ChatCompletionRequest, client=None):
        if req.stream and not req.logprobs and not (req.tools and req.tool_choice != "none"):
            live = LiveRows()
            plan = await asyncio.to_thread(self.plan_chat, req, live.progress)
            return self.live_response(req, plan, live, chat=True)
        plan = await asyncio.to_thread(self.plan_chat, req)
        prompt = plan.prompts[0]
        completions = await self.generate(plan.served, plan.rows, client, req.partial_rollout)
        choices = await asyncio.to_thread(self.finished, req, plan.rule, completions, req.n)
        top = req.top_logprobs or 0
        scores = await self.score(plan.served, [prompt + c.tokens for c in choices], top, client) if top else None
        body = await asyncio.to_thread(lambda: self._chat_body(req, plan, choices, scores,
                                                               self.token_versions(req, completions, choices)))
        if req.stream:
            return StreamingResponse(self._stream_chat(req, body, choices), media_type="text/event-stream")
        return await json_response(body)

    def _chat_body(self, req, plan: "Plan", choices: list[Finished], scores, versions: Optional[list] = None) -> dict:
        prompt = plan.prompts[0]
        out = []
        parse = bool(req.tools) and req.tool_choice != "none"
        for idx, c in enumerate(choices):
            choice = {"index": idx, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            content, calls = parse_tool_calls(c.text, req.tools) if parse else (c.text, None)
            if calls:  # Qwen3.5's <tool_call> blocks, as OpenAI tool_calls (a malformed one stays text)
                choice["message"] = {"role": "assistant", "content": content,
                                     "tool_calls": [call.openai(new_id("call")) for call in calls]}
                choice["finish_reason"] = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
            if req.logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(req, prompt, c, scores[idx] if scores else None)}
            if req.return_token_ids:
                choice["token_ids"] = list(c.tokens)
            if versions is not None:
                choice.update(versions[idx])
            out.append(choice)
        return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": plan.served.name,
                "choices": out, "usage": usage(len(prompt), sum(len(c.tokens) for c in choices))}

    def _chat_logprobs(self, req, prompt: list, c: Finished, score) -> list:
        as_ids = req.return_tokens_as_token_ids
        strings = token_strings(self.tokenizer, c.tokens, as_ids)
        start = len(prompt) - 1
        values = c.logprobs if score is None else score.logprobs[start:start + len(c.tokens)]
        entries = []
        for k, (s, v) in enumerate(zip(strings, values)):
            top = []
            if score is not None:
                for t, x in zip(score.top_ids[start + k], score.top_logprobs[start + k]):
                    ts = token_strings(self.tokenizer, [t], as_ids)[0]
                    top.append({"token": ts, "logprob": float(x), "bytes": list(ts.encode("utf-8"))})
            entries.append({"token": s, "logprob": float(v), "bytes": list(s.encode("utf-8")), "top_logprobs": top})
        return entries

    # ------------------------------------------------------------------------------------------ live streams
    def live_response(self, req, plan: "Plan", live: "LiveRows", *, chat: bool) -> StreamingResponse:
        """A stream whose chunks leave as the rows are sampled: each row's new text at every round end (text that
        could still turn out to be the start of a stop string is held back), then each row's rest (the stopping
        rule applied) and its finish reason. The rows are queued before the response starts, so an overloaded
        server still answers 503; a client that goes away cancels them (the generator is closed)."""
        try:
            future = self.loop.generate(plan.served.name, plan.rows) if plan.rows else None
        except (Overloaded, ShuttingDown) as e:
            raise ApiError(str(e), 503) from None
        return StreamingResponse(self._live_chunks(req, plan, live, future, chat), media_type="text/event-stream")

    def _live_pieces(self, req, rule: StopRule, tokens: list, sent: int, sent_text: str) -> list[str]:
        """The per-token pieces of a running row after its first `sent` tokens that are sure to be in its answer:
        its text so far, less a last character still missing bytes, cut before any stop string it holds and less
        what could still become the start of one (the rule's `sure_length`). A token's piece depends on the tokens
        up to it only, so these are the pieces the finished row will have."""
        pieces = token_pieces(self.tokenizer, tokens, req.skip_special_tokens)
        sure = rule.sure_length("".join(pieces))
        out, at = [], len(sent_text)
        for piece in pieces[sent:]:
            if at + len(piece) > sure:
                break
            out.append(piece)
            at += len(piece)
        return out

    async def _live_chunks(self, req, plan: "Plan", live: "LiveRows", future, chat: bool):
        count = len(plan.prompts) * req.n
        head = {"id": new_id("chatcmpl" if chat else "cmpl"), "object": "chat.completion.chunk" if chat else
                "text_completion", "created": now(), "model": plan.served.name}

        def chunk(i: int, text: Optional[str] = None, finish: Optional[str] = None, stop_reason=None,
                  role: bool = False) -> str:
            """The chunks of the whole-row stream (`_stream_completion`, `_stream_chat`), field for field."""
            if not chat:
                return sse({**head, "choices": [{"index": i, "text": text or "", "logprobs": None,
                                                  "finish_reason": finish, "stop_reason": stop_reason}]})
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            return sse({**head, "choices": [choice]})

        sent, sent_text = [0] * count, [""] * count  # per row: tokens whose pieces went out, and their text
        started = [False] * count
        waiter = asyncio.wrap_future(future) if future is not None else None
        try:
            while waiter is not None and not waiter.done():
                getter = asyncio.ensure_future(live.queue.get())
                done, _ = await asyncio.wait({waiter, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    continue
                latest = dict([getter.result()])
                while not live.queue.empty():  # a round's reports at once; only each row's newest counts
                    i, tokens = live.queue.get_nowait()
                    latest[i] = tokens
                for i, tokens in sorted(latest.items()):
                    pieces = await asyncio.to_thread(self._live_pieces, req, plan.rule, tokens, sent[i], sent_text[i])
                    if pieces and chat and not started[i]:
                        yield chunk(i, role=True)
                    started[i] = started[i] or bool(pieces)
                    for piece in pieces:
                        yield chunk(i, piece)
                    sent[i] += len(pieces)
                    sent_text[i] += "".join(pieces)
            try:
                completions = waiter.result() if waiter is not None else []
            except Exception as e:  # noqa: BLE001 - the response has started: the error goes in the stream
                status = 503 if isinstance(e, (Overloaded, ShuttingDown, Cancelled)) else 500
                yield sse({"error": ApiError(f"{type(e).__name__}: {e}", status).body()["error"]})
                return
            rows = await asyncio.to_thread(self.finished, req, plan.rule, completions, count)
            for i, row in enumerate(rows):
                pieces = clip_pieces(token_pieces(self.tokenizer, row.tokens, req.skip_special_tokens), row.text)
                if chat and not started[i]:
                    yield chunk(i, role=True)
                for piece in pieces[sent[i]:]:
                    yield chunk(i, piece)
                yield chunk(i, None, finish=row.finish_reason, stop_reason=row.stop_reason)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": usage(sum(len(p) for p in plan.prompts),
                                                                   sum(len(r.tokens) for r in rows))})
            yield sse("[DONE]")
        finally:
            if future is not None and not future.done():  # the client went away: its rows leave the engine
                self.loop.cancel(future)

    def _stream_chat(self, req, body: dict, choices: list[Finished]):
        head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                "model": body["model"]}
        for idx, c in enumerate(choices):
            yield sse({**head, "choices": [{"index": idx, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
            full = body["choices"][idx]
            if "tool_calls" in full["message"]:  # the text before the calls, then the calls in one delta
                if full["message"]["content"]:
                    yield sse({**head, "choices": [{"index": idx, "delta": {"content": full["message"]["content"]},
                                                    "logprobs": None, "finish_reason": None}]})
                calls = [{"index": k, **call} for k, call in enumerate(full["message"]["tool_calls"])]
                yield sse({**head, "choices": [{"index": idx, "delta": {"tool_calls": calls}, "logprobs": None,
                                                "finish_reason": None}]})
                yield sse({**head, "choices": [{"index": idx, "delta": {}, "logprobs": None,
                                                "finish_reason": full["finish_reason"], "stop_reason": c.stop_reason}]})
                continue
            entries = (full["logprobs"] or {}).get("content")
            for k, piece in enumerate(clip_pieces(token_pieces(self.tokenizer, c.tokens, req.skip_special_tokens),
                                                  c.text)):
                lp = None if entries is None else {"content": entries[k:k + 1]}
                yield sse({**head, "choices": [{"index": idx, "delta": {"content": piece}, "logprobs": lp,
                                                "finish_reason": None}]})
            yield sse({**head, "choices": [{"index": idx, "delta": {}, "logprobs": None,
                                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": body["usage"]})
        yield sse("[DONE]")


@dataclasses.dataclass
class Plan:
    """A request checked and prepared: the model, its prompts' ids (and texts), the stopping rule, the rows."""

    served: Served
    prompts: list[list[int]]
    texts: list[Optional[str]]
    rule: StopRule
    rows: list[Request]


class ClientGone(ApiError):
    """The client disconnected before its answer: nothing is sent (HTTP 499, nginx's "client closed request")."""

    def __init__(self, message: str):
        super().__init__(message, 499)


async def client_gone(client) -> None:
    """Returns once the HTTP client of `client` (a Starlette Request whose body was read) has disconnected."""
    while True:
        message = await client.receive()
        if message["type"] == "http.disconnect":
            return


def encode_json(body: dict) -> bytes:
    """The JSON of a response, one choice at a time: each json.dumps call holds the interpreter lock, so a large
    response is encoded in pieces that let the event loop's thread run between them."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        return json.dumps(body).encode()
    head = json.dumps({**body, "choices": []}).encode()
    marker = b'"choices": []'
    at = head.index(marker)
    parts = b", ".join(json.dumps(c).encode() for c in choices)
    return head[:at] + b'"choices": [' + parts + b"]" + head[at + len(marker):]


async def json_response(body: dict, status: int = 200) -> Response:
    return Response(await asyncio.to_thread(encode_json, body), status, media_type="application/json")


class LiveRows:
    """The tokens of a streamed request's rows as the engine reports them (its thread) for the event loop."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()

    def progress(self, row: int, tokens: list) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (row, tokens))
