"""The teacher of on-policy distillation on OpenAI-compatible servers (`distill.teacher_backend = "server"` |
"vllm"): every row's teacher-forced top-k log-probs from POST /v1/completions, in the arrays the in-process teacher
(jaxrl/backends/jax_teacher.py) makes, so the loss cannot tell which one scored a batch. Both are `Scorer`s
(jaxrl.backends.base), built from their specs (`ServerTeacherSpec`, `VLLMTeacherSpec`: jaxrl.backends.scorers).

    teacher = ServerTeacher(["http://127.0.0.1:8001"], k=16, width=P + C)     # probes every server: ServerError
    teacher = VLLMTeacher(["http://gpu-host:8000"], k=16, width=P + C)        # vLLM's prompt_logprobs
    scores = teacher.score(arrays, k=16, temperature=1.0)
    # {"logp": [N, C] the sampled token's, "top_logp" / "top_ids": [N, C, k], "rest_logp": [N, C]}

`VLLMTeacher` asks in vLLM's own form instead (`VLLMTeacher` docstring): `prompt_logprobs: k` with `max_tokens: 1`,
read off the choice's `prompt_logprobs` list; launchers.serve answers that form too, so both clients are tested
against a real server.

One request per row: `prompt` = the row's attended token ids (prompt + completion, the padding dropped), `max_tokens:
0`, `echo: true`, `logprobs: k`, `return_tokens_as_token_ids: true`, so the server scores exactly our ids (nothing is
re-tokenised) and keys each top-k entry "token_id:N" (launchers.serve; vLLM's completions API does the same). Entry
j of the echoed `token_logprobs` / `top_logprobs` is token j's log-prob given tokens < j (entry 0 is null): the
teacher-forced layout the in-process teacher reads off column P + t - 1 for completion token t. A top-k dict also
holds the token itself when it is outside the k (vLLM's convention, and ours); the k most likely entries are kept,
in the server's order (most likely first).

The remainder bucket (`rest_logp`, the mass of every token outside the top k) is log(1 - sum of the k
probabilities): a server gives only k entries, where the in-process teacher sums the other V - k. Each entry is a
float32 log-prob, so the mass differs from the in-process one by ~k x 1e-7 absolute (float32 rounding); its log
differs noticeably only when the remainder itself is that small (then its weight in the losses is as small). A sum
at or above 1 (k = V, or rounding) gives LOG_FLOOR, the losses' floor for an empty bucket.

Log-probs are at temperature 1 (servers return raw log-probs: vLLM's raw_logprobs mode, and ours): the config
refuses another `distill.temperature` with this backend. Rows go out through jaxrl.backends.waiting.send_all
(`concurrency` in flight per server, rows split round-robin over the servers, a progress line, SIGINT honoured);
a reset connection or HTTP 503 is retried (scoring is deterministic). Everything that can refuse a server
(down, answering garbage, fewer than k log-probs, a row of `width` tokens refused) is found by the probe in
the constructor, before any training step. The servers are a fleet (jaxrl.backends.fleet): a server that stops
answering later (refused, reset, timed out) is taken out and its rows are scored by the others (the same scores:
scoring is deterministic); it rejoins once it passes the constructor's probe again. With none left the step waits
up to `distill.teacher_server.fleet_wait_s`, then stops in one line, and the run resumes from its last
checkpoint once a server is back. A server that answers wrongly (an HTTP error, bad log-probs) still fails the
step naming it: that is not a lost server but a wrong one.
"""

from __future__ import annotations

import functools
import logging
from typing import Sequence

import numpy as np

from jaxrl.backends.base import Scorer
from jaxrl.backends.openai_client import (RETRY_BACKOFF_S, ServerError, error_message, http_json, request_timeout,
                                          same_folder)
from jaxrl.backends.fleet import Fleet
from jaxrl.backends.waiting import send_all

logger = logging.getLogger(__name__)

LOG_FLOOR = -1.0e4  # = jaxrl.algorithms.distill_loss.LOG_FLOOR (backends do not import algorithms)
ID_PREFIX = "token_id:"


def _id_of(key, url: str) -> int:
    if not (isinstance(key, str) and key.startswith(ID_PREFIX) and key[len(ID_PREFIX):].isdigit()):
        raise ServerError(f"the teacher server at {url} keyed a log-prob entry {str(key)[:40]!r}, not "
                          f"'{ID_PREFIX}N': it ignored return_tokens_as_token_ids")
    return int(key[len(ID_PREFIX):])


def parse_scores(payload, sequence: Sequence[int], k: int, url: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logp [L], top_logp [L, k], top_ids [L, k]) of an echo answer for `sequence` (L tokens; entry 0, which has
    no log-prob, is 0); ServerError (one line naming `url`) for anything else."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    lp = choices[0].get("logprobs") if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list) \
            or not isinstance(lp.get("top_logprobs"), list):
        raise ServerError(f"the teacher server at {url} answered with something that is not an echoed completion "
                          f"with log-probs ({str(payload)[:120]!r}...)")
    values, tops, tokens = lp["token_logprobs"], lp["top_logprobs"], lp.get("tokens")
    L = len(sequence)
    if len(values) != L or len(tops) != L:
        raise ServerError(f"the teacher server at {url} echoed {len(values)} log-probs for a prompt of {L} tokens "
                          f"(echo with max_tokens 0 must return one per prompt token)")
    if isinstance(tokens, list) and [_id_of(t, url) for t in tokens] != [int(t) for t in sequence]:
        raise ServerError(f"the teacher server at {url} scored other tokens than it was sent (it re-tokenised the "
                          f"prompt?)")
    logp, top_logp, top_ids = np.zeros(L, np.float64), np.zeros((L, k), np.float64), np.zeros((L, k), np.int64)
    for j in range(1, L):
        entry = tops[j]
        if not isinstance(entry, dict) or len(entry) < k:
            n = len(entry) if isinstance(entry, dict) else 0
            raise ServerError(f"the teacher server at {url} returned {n} top log-probs at position {j}, fewer than "
                              f"distill.teacher_top_k={k}")
        try:
            items = [(_id_of(key, url), float(v)) for key, v in entry.items()]
            logp[j] = float(values[j])
        except (TypeError, ValueError):
            raise ServerError(f"the teacher server at {url} returned a log-prob that is not a number at position "
                              f"{j}") from None
        # most likely first; a stable sort keeps the server's order among ties, and the token itself (appended
        # when outside the top k) after the k it ties with
        items = sorted(items, key=lambda kv: -kv[1])[:k]
        top_ids[j], top_logp[j] = [i for i, _ in items], [v for _, v in items]
    return logp, top_logp, top_ids


# How far above 0 a served log-prob (or the top-k's log total) may round before it is not a probability: a server
# computing in bf16 rounds a certain token's log-prob to a few 1e-3 either side of 0.
LOGP_SLACK = 1e-2


def check_logprobs(logp: np.ndarray, top_logp: np.ndarray, url: str) -> None:
    """ServerError naming `url` unless every served log-prob (positions 1..L-1: the token's own and the top k) is a
    finite number <= 0 and the top k's probabilities sum to at most 1: a server answering +5.0 or NaN would
    otherwise be trained on (a loss of 12,300) or skip every update without a word."""
    own, top = np.asarray(logp, np.float64)[1:], np.asarray(top_logp, np.float64)[1:]
    for name, values in (("a token's log-prob", own), ("a top-k log-prob", top)):
        bad = np.argwhere(~np.isfinite(values) | (values > LOGP_SLACK))
        if bad.size:
            j = int(bad[0][0]) + 1
            value = float(values[tuple(bad[0])])
            raise ServerError(f"the teacher server at {url} returned {name} of {value} at position {j}: a log-prob is "
                              "a finite number <= 0 (a broken or misconfigured server); this request fails rather "
                              "than train on it")
    total = np.exp(top).sum(-1) if top.size else np.zeros(0)
    if (total > np.exp(LOGP_SLACK)).any():
        j = int(np.argmax(total > np.exp(LOGP_SLACK)))
        raise ServerError(f"the teacher server at {url} returned top-k log-probs whose probabilities sum to "
                          f"{float(total[j]):.4g} > 1 at position {j + 1}: not a distribution; this request fails")


def rest_logp(top_logp: np.ndarray) -> np.ndarray:
    """log(1 - sum exp(top_logp)) over the last axis (module docstring: ~1e-7 from the in-process remainder)."""
    mass = 1.0 - np.exp(np.asarray(top_logp, np.float64)).sum(-1)
    with np.errstate(divide="ignore"):
        return np.where(mass > 0, np.log(np.maximum(mass, 1e-300)), LOG_FLOOR)


class ServerTeacher(Scorer):
    """A teacher served over HTTP (module docstring). `width`: the longest row (P + C) a step sends; `vocab_size`:
    the student's, which every returned id must be below; `teacher_path`: the folder the servers should serve
    (a warning when a server reports another)."""

    name = "server"
    K_FIELD = "logprobs"  # the request field that carries k (named in a refusal)

    def __init__(self, urls: Sequence[str], *, k: int, width: int, vocab_size: int = 0, teacher_path: str = "",
                 concurrency: int = 64, request_timeout_s: float = 0.0, progress_every_s: float = 30.0,
                 fleet_wait_s: float = 600.0):
        self.urls = [str(u).rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("ServerTeacher needs at least one server URL (distill.teacher_servers)")
        self.k, self.width, self.vocab_size = int(k), int(width), int(vocab_size)
        self.concurrency, self.progress_every_s = max(1, int(concurrency)), float(progress_every_s)
        self.timeout_s = request_timeout(0, request_timeout_s)
        self.models = {url: self._probe(url, teacher_path) for url in self.urls}
        self.fleet = Fleet(len(self.urls), name=self.urls.__getitem__, what="teacher server",
                           rejoin=functools.partial(self._rejoin, teacher_path=teacher_path), wait_s=fleet_wait_s,
                           progress_every_s=self.progress_every_s, wait_setting="distill.teacher_server.fleet_wait_s")

    # ------------------------------------------------------------------------------------------------ probe
    def _rejoin(self, k: int, teacher_path: str) -> bool:
        """A lost server is back once it passes the constructor's probe again (the model id it serves re-read)."""
        self.models[self.urls[k]] = self._probe(self.urls[k], teacher_path)
        return True

    def _probe(self, url: str, teacher_path: str) -> str:
        """The model id `url` serves, once a row of `width` tokens came back with k log-probs at every position."""
        try:
            status, payload = http_json("GET", url + "/v1/models", timeout=30.0)
        except ServerError as e:
            raise type(e)(f"distill.teacher_servers: {e}") from None
        cards = payload.get("data") if isinstance(payload, dict) else None
        base = next((c for c in cards if isinstance(c, dict) and not c.get("parent")), None) \
            if status == 200 and isinstance(cards, list) else None
        if base is None or "id" not in base:
            raise ServerError(f"the teacher server at {url}: GET /v1/models answered HTTP {status} without a base "
                              f"model ({str(payload)[:120]!r}): not an OpenAI-compatible server")
        root = base.get("root") or base["id"]
        if teacher_path and not same_folder(root, teacher_path):
            logger.warning("the teacher server at %s serves %r, not distill.teacher_path=%s (another machine's path "
                           "of the same folder is fine; another model is not)", url, root, teacher_path)
        # the longest row a step sends: an id every vocabulary has, repeated (what the server must accept is the
        # length, the response size at k and the key format; the values are not looked at)
        sequence = [0] * max(self.width, 2)
        self._post(url, base["id"], sequence)
        return base["id"]

    def _body(self, model: str, sequence: list[int]) -> dict:
        return {"model": model, "prompt": sequence, "max_tokens": 0, "echo": True, "logprobs": self.k,
                "return_tokens_as_token_ids": True, "n": 1, "temperature": 1.0}

    def _parse(self, payload, sequence: list[int], url: str):
        return parse_scores(payload, sequence, self.k, url)

    def _post(self, url: str, model: str, sequence: list[int]):
        body = self._body(model, sequence)
        try:
            status, payload = http_json("POST", url + "/v1/completions", body, timeout=self.timeout_s,
                                        retries=len(RETRY_BACKOFF_S),
                                        timeout_setting="distill.teacher_server.request_timeout_s")
        except ServerError as e:
            raise type(e)(f"distill.teacher_servers: {e}") from None
        if status != 200:
            raise ServerError(f"the teacher server at {url} refused a row of {len(sequence)} tokens with {self.K_FIELD}="
                              f"{self.k}: HTTP {status}: {error_message(payload)}".replace("\n", " "))
        logp, top_logp, top_ids = self._parse(payload, sequence, url)
        check_logprobs(logp, top_logp, url)
        if self.vocab_size and top_ids.size and top_ids.max() >= self.vocab_size:
            raise ServerError(f"the teacher server at {url} returned token id {int(top_ids.max())}, outside the "
                              f"student's vocabulary of {self.vocab_size}: it serves another model")
        return logp, top_logp, top_ids

    # ------------------------------------------------------------------------------------------------ score
    def score(self, arrays: dict, *, k: int, temperature: float, batch_size: int = 0, chunk_size: int = 0) -> dict:
        """The teacher's view of every row of `arrays` (input_ids, attention_mask [N, P + C], completion_mask
        [N, C]), as the in-process teacher's (JaxTeacher.score): zero (ids 0) off the completion mask.
        batch_size / chunk_size: the in-process teacher's; the servers batch on their own."""
        if int(k) != self.k:
            raise ValueError(f"ServerTeacher was probed for k={self.k}, asked for k={k}")
        if float(temperature) != 1.0:
            raise ValueError(f"teacher servers score at temperature 1; asked for {temperature}")
        self.fleet.try_rejoin()  # the servers lost at an earlier step that answer again
        ids, attn = np.asarray(arrays["input_ids"]), np.asarray(arrays["attention_mask"])
        mask = np.asarray(arrays["completion_mask"]) > 0
        N, C = mask.shape
        P = ids.shape[1] - C
        out = {"logp": np.zeros((N, C), np.float32), "top_logp": np.zeros((N, C, self.k), np.float32),
               "top_ids": np.zeros((N, C, self.k), np.int32), "rest_logp": np.zeros((N, C), np.float32)}
        jobs, where = [], []
        for i in range(N):
            if not mask[i].any():
                continue
            cols = np.nonzero(attn[i])[0]  # the attended columns, in order: the row as the server sees it
            at = np.full(ids.shape[1], -1)
            at[cols] = np.arange(len(cols))
            t = np.nonzero(mask[i])[0]
            j = at[P + t]  # sequence position of completion token t: its log-prob is entry j of the echo
            if (j < 1).any():
                raise ValueError(f"row {i}: a completion token is not attended (attention_mask 0) or has no token "
                                 "before it")
            k_server = len(jobs) % len(self.urls)
            sequence = ids[i, cols].tolist()

            def call(server, sequence=sequence):
                return self._post(self.urls[server], self.models[self.urls[server]], sequence)
            jobs.append((self.urls[k_server], 1, functools.partial(self.fleet.send, k_server, call, spread=len(jobs))))
            where.append((i, t, j))
        results = send_all(jobs, concurrency={u: self.concurrency for u in self.urls},
                           progress_every_s=self.progress_every_s, what=f"teacher scores of {len(jobs)} rows")
        for (i, t, j), (_, (logp, top_logp, top_ids)) in zip(where, results):
            out["logp"][i, t] = logp[j]
            out["top_logp"][i, t] = top_logp[j]
            out["top_ids"][i, t] = top_ids[j]
            out["rest_logp"][i, t] = rest_logp(top_logp[j])
        return out


def parse_prompt_logprobs(payload, sequence: Sequence[int], k: int, url: str):
    """(logp [L], top_logp [L, k], top_ids [L, k]) of a vLLM answer with `prompt_logprobs` for `sequence` (entry 0
    is 0); ServerError (one line naming `url`) for anything else. Entry j of the choice's `prompt_logprobs` is
    {"<id>": {"logprob", "rank", "decoded_token"}}: the prompt token's own entry (its vocabulary rank) and the k most
    likely (ranks 1..k) in one dict, so it has k entries when the token is among the k and k + 1 when not
    (vllm/logprobs.py:178-209, vllm/v1/sample/sampler.py:373-418); a -inf log-prob comes as -9999.0
    (vllm/entrypoints/generate/base/serving.py:381-393)."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    plp = choices[0].get("prompt_logprobs") if isinstance(choices, list) and choices \
        and isinstance(choices[0], dict) else None
    if not isinstance(plp, list):
        raise ServerError(f"the teacher server at {url} answered without a choice's prompt_logprobs list "
                          f"({str(payload)[:120]!r}...): not vLLM, or it ignored prompt_logprobs")
    L = len(sequence)
    if len(plp) != L:
        raise ServerError(f"the teacher server at {url} returned {len(plp)} prompt_logprobs entries for a prompt of "
                          f"{L} tokens (one per prompt token)")
    echoed = choices[0].get("prompt_token_ids")
    if isinstance(echoed, list) and [int(t) for t in echoed] != [int(t) for t in sequence]:
        raise ServerError(f"the teacher server at {url} scored other tokens than it was sent")
    logp, top_logp, top_ids = np.zeros(L, np.float64), np.zeros((L, k), np.float64), np.zeros((L, k), np.int64)
    for j in range(1, L):
        entry, token = plp[j], str(int(sequence[j]))
        if not isinstance(entry, dict) or token not in entry or len(entry) not in (k, k + 1):
            n = len(entry) if isinstance(entry, dict) else 0
            what = "without the prompt token's own entry" if isinstance(entry, dict) and n >= k else \
                f"{n} entries, fewer than distill.teacher_top_k={k}" if n < k else f"{n} entries, more than k + 1"
            raise ServerError(f"the teacher server at {url} returned prompt_logprobs at position {j} {what}")
        try:
            own = entry[token]
            logp[j] = float(own["logprob"])
            top = [(int(key), float(v["logprob"]), int(v["rank"])) for key, v in entry.items()
                   if len(entry) == k or key != token]  # k + 1 entries: the token itself is outside the top k
        except (TypeError, ValueError, KeyError):
            raise ServerError(f"the teacher server at {url} returned a prompt_logprobs entry at position {j} that is "
                              f"not {{id: {{logprob, rank}}}}") from None
        top.sort(key=lambda e: e[2])  # ranks 1..k: torch.topk's order, ties included
        top_ids[j], top_logp[j] = [i for i, _, _ in top], [v for _, v, _ in top]
    return logp, top_logp, top_ids


class VLLMTeacher(ServerTeacher):
    """The teacher on vLLM servers (`distill.teacher_backend = "vllm"`): one request per row in vLLM's form,
    `prompt_logprobs: k` and `max_tokens: 1` (vLLM samples at least one token; it is thrown away), read by
    `parse_prompt_logprobs`. vLLM's prompt log-probs are raw, before any temperature (vllm/config/model.py:291-300),
    and its k is bounded by `vllm serve --max-logprobs` (20 by default, vllm/config/model.py:286): a larger
    `distill.teacher_top_k` is refused by the probe, naming the server. A server must hold P + C + 1 tokens
    (`--max-model-len`)."""

    name = "vllm"
    K_FIELD = "prompt_logprobs"

    def _body(self, model: str, sequence: list[int]) -> dict:
        # vllm/entrypoints/openai/completion/protocol.py:99 (prompt_logprobs), :172 (return_token_ids), :389-418
        return {"model": model, "prompt": sequence, "max_tokens": 1, "prompt_logprobs": self.k, "n": 1,
                "temperature": 0.0, "return_token_ids": True}

    def _parse(self, payload, sequence: list[int], url: str):
        return parse_prompt_logprobs(payload, sequence, self.k, url)
