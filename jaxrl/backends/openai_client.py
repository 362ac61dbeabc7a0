"""A generation backend that talks to an OpenAI-compatible completions server: vLLM 0.33 (`vllm serve`, in its own
environment, docs/guides/vllm.md) or jaxrl's own JAX server (`python -m launchers.serve`).

    backend = ServerBackend(HF_DIR, url="http://127.0.0.1:8000", out_dir="run/eval", stop_ids=stop_ids)
    backend.load(ModelSpec("step_28", "adapter", "run/checkpoints/adapters/28"), adapter)   # served as LoRA
    gens = backend.generate(prompts, group_ids, SamplingParams(n=8, max_new_tokens=4096, temperature=1.0))

Token ids in, token ids out: each prompt is one POST /v1/completions with `prompt` = our token ids (our chat
template, our stop ids), `n` samples, `max_tokens`, the sampling controls, `stop_token_ids`, `logprobs: 0` (the
sampled token's log-probability; vLLM 0.33's default logprobs mode is raw_logprobs, vllm/config/model.py:291,
i.e. temperature 1 and unfiltered, as ours) and `return_token_ids: true`.

Seeds: a request's `seed` packs (seed, group id, sample index 0) into one int64
(`jaxrl.generation.sampling.request_seed`). vLLM gives sample i of a request the seed `seed + i`
(vllm/v1/engine/parallel_sampling.py:69-81), which is the packed seed of (seed, group id, i): so sample i of a
prompt is drawn from a seed that depends on (seed, group id, i) only, never on its batch or on n. The JAX server
reads the same packing back and samples with the jax backend's own keys, so its samples equal the in-process jax
backend's.

Adapters are served unmerged, as LoRA: a PEFT folder (the given one when it is a PEFT export in the base's
layout, else exported once under `<out_dir>/peft/<name>`) loaded through POST /v1/load_lora_adapter (vLLM needs
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) unless the server already lists it (e.g. `--lora-modules` at start-up).
`loaded_digest()` re-reads what the server reports it serves (/v1/models: the adapter folder, or the digest the
JAX server reads back from its parameters). A full HF folder (`kind="hf"`, e.g. a merged export) needs a server of
that folder: a launched vLLM is restarted on it; a server given by URL must already serve it. Online training sends
every new version of its adapter with `serve_adapter_version` (new version loaded, then the old one unloaded; the
served digest returned for the trainer to check: `jaxrl.backends.pool`).

Token versions (`return_token_versions=True`, `launchers.serve` only): requests ask for each token's adapter digest
(the server's `token_versions` / `version_digests` extension fields), kept per token in
`Generation.token_digests`; an answer without them, or with one per token missing, is a one-line error.
`partial=True` (partial rollouts) also marks every request `partial_rollout` (the wire's name: its rows continue under
an adapter reloaded in place while they run: `serve_adapter_version(..., in_place=True)`) and implies token
versions.

Clear errors (ServerError) when no server answers, when it is older than vLLM 0.33 (GET /version), when it
serves another base, or when it rejects an adapter or a request (the server's own message is quoted). A completion
request whose connection the server resets (a full listen backlog, a restart) or that it answers with HTTP 503
(overloaded) is sent again after a pause (`RETRY_BACKOFF_S`): seeded, it draws the same samples. A request that
takes longer than its timeout (`request_timeout_s`; by default sized from its max_tokens: `request_timeout`; the
whole request, not each read: a server dripping a byte at a time cannot hold it) fails the rollout naming the
server; while requests are out a progress line says what each server answered, and a
SIGINT stops the wait (jaxrl.backends.waiting). An answer that is not the JSON of a completion is a one-line error.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

from jaxrl.export.merge import read_provenance
from jaxrl.models.peft import export_peft, is_peft_folder, layout_of, read_peft_adapter
from jaxrl.backends.base import Generation, ModelSpec, Policy, RolloutBackend, SamplingParams
from jaxrl.backends.fleet import ServerLost
from jaxrl.backends.waiting import send_all
from jaxrl.generation.sampling import request_seed
from jaxrl.generation.stopping import with_stop_token
from jaxrl.serve.protocol import JAXRL_SERVER
from jaxrl.backends.options import ServerOptions

logger = logging.getLogger(__name__)

TARGET_VLLM = (0, 33)  # the vLLM version this module's requests, seeds and LoRA handling are written against


class ServerError(RuntimeError):
    """A server that is missing, too old, serving something else, or refusing a request; says what to do."""


class UnreachableServer(ServerError, ServerLost):
    """Nothing answered: the connection was refused, reset past its retries, or the request passed its timeout. A
    fleet of servers (jaxrl.backends.fleet) takes such a server out and sends the request to another."""


# ---------------------------------------------------------------------------------------------------------------
# HTTP

# A connection the server dropped (a full listen backlog resets it, a restarting server closes it): worth another
# try after a pause. A refused connection is not retried (no server there: say so at once).
RESET_ERRORS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, http.client.RemoteDisconnected,
                http.client.IncompleteRead)
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # pauses before the retries of a reset request (and of HTTP 503)
# The default timeout of one completion request: a base for queueing and prefill, and a budget per token of its
# max_tokens (0.1 s a token is ~10x an H200's 4B decode step under a full batch: generous, yet a 4,096-token
# request on a hung server fails in 8 minutes, not the hour the old flat default waited).
TIMEOUT_BASE_S, TIMEOUT_PER_TOKEN_S = 60.0, 0.1


def request_timeout(max_tokens: int, configured_s: float = 0.0) -> float:
    """The seconds a completion request of `max_tokens` may take: `configured_s`, or when 0 the sized default."""
    return float(configured_s) if configured_s else TIMEOUT_BASE_S + TIMEOUT_PER_TOKEN_S * int(max_tokens)


# The setting a timeout message names by default (a teacher's request names distill.teacher_server's).
ROLLOUT_TIMEOUT_SETTING = ("rollout_server.request_timeout_s, or --server_request_timeout_s for offline rollouts and "
                           "evaluation")


class _Deadline:
    """The whole request's time limit: at the deadline the sockets the request opened are shut, so a server that
    sends a byte every few seconds (each read within the socket timeout) cannot hold the request for good."""

    def __init__(self, seconds: float):
        self.expired = False
        self._socks: list = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(float(seconds), 0.0), self._expire)
        self._timer.daemon = True

    def watch(self, sock) -> None:
        with self._lock:
            self._socks.append(sock)
            if self.expired:
                self._shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._socks:
                self._shut(sock)

    @staticmethod
    def _shut(sock) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


class _WatchedConnection(http.client.HTTPConnection):
    def __init__(self, *args, watch, **kwargs):
        super().__init__(*args, **kwargs)
        self._watch = watch

    def connect(self):
        super().connect()
        self._watch(self.sock)


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    """urllib's HTTP handler (proxies still apply) whose connections report their socket to a `_Deadline`."""

    def __init__(self, watch):
        super().__init__()
        self._watch = watch

    def http_open(self, req):
        return self.do_open(functools.partial(_WatchedConnection, watch=self._watch), req)


def http_json(method: str, url: str, body: Optional[dict] = None, timeout: float = 30.0, retries: int = 0,
              backoff_s: Sequence[float] = RETRY_BACKOFF_S, timeout_setting: str = ROLLOUT_TIMEOUT_SETTING):
    """(status, parsed JSON or text) of one request; ServerError when nothing answers at `url`.

    timeout: seconds the whole request may take (connecting, sending, the answer's every byte), not one read.
    retries: how many times a reset connection (RESET_ERRORS) or an HTTP 503 (overloaded) is tried again, after
    the pauses of `backoff_s` (the last one repeated); only for requests that are safe to repeat (a seeded
    completion gives the same samples twice). timeout_setting: the setting a timeout's message names."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    for attempt in range(int(retries) + 1):
        pause = backoff_s[min(attempt, len(backoff_s) - 1)] if backoff_s else 0.0
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        with _Deadline(timeout) as deadline:
            try:
                try:
                    opener = urllib.request.build_opener(_WatchedHTTPHandler(deadline.watch))
                    with opener.open(req, timeout=timeout) as resp:
                        status, raw = resp.status, resp.read()
                except urllib.error.HTTPError as e:
                    status, raw = e.code, e.read()
                if deadline.expired:  # cut off at the deadline: what arrived is not the answer
                    raise TimeoutError("the request's deadline passed")
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError) or deadline.expired:
                    raise UnreachableServer(f"the server at {url} did not answer within {timeout:g} s (a hung or "
                                            f"overloaded server; the timeout is {timeout_setting})") from None
                if isinstance(reason, RESET_ERRORS) and attempt < retries:
                    logger.warning("%s %s: connection reset (%s); retrying in %.1f s", method, url, reason, pause)
                    time.sleep(pause)
                    continue
                raise UnreachableServer(f"no server answers at {url} ({reason}); start one (`vllm serve`, "
                                        "docs/guides/vllm.md, or `python -m launchers.serve`) or pass the URL of a "
                                        "running one") from None
        if status == 503 and attempt < retries:
            logger.warning("%s %s: HTTP 503 (overloaded); retrying in %.1f s", method, url, pause)
            time.sleep(pause)
            continue
        break
    text = raw.decode("utf-8", errors="replace")
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


def error_message(payload) -> str:
    """The message of an OpenAI / vLLM error body ({"error": {"message": ...}}), else the body itself."""
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if payload.get("detail"):
            return str(payload["detail"])
        if payload.get("message"):
            return str(payload["message"])
    return str(payload)[:2000]


def parse_version(text: str) -> tuple[int, ...]:
    """(0, 33, 0) of "0.33.0", "0.33.1.dev4+gabc", "v0.33"; () when it has no leading number."""
    m = re.match(r"v?(\d+(?:\.\d+)*)", str(text).strip())
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def check_version(info, url: str) -> str:
    """Describes the server of a /version reply; ServerError for a vLLM older than TARGET_VLLM."""
    if isinstance(info, dict) and info.get("server") == JAXRL_SERVER:
        return f"jaxrl {info.get('version', '?')}"
    version = info.get("version") if isinstance(info, dict) else None
    parsed = parse_version(version or "")
    target = ".".join(map(str, TARGET_VLLM))
    if not parsed:
        raise ServerError(f"{url}/version answered {info!r}: not a vLLM (or jaxrl) server this backend can check; "
                          f"it targets vLLM {target}")
    if parsed[:2] < TARGET_VLLM:
        raise ServerError(f"the server at {url} runs vLLM {version}, older than the vLLM {target} this backend "
                          f"targets (its Qwen3.5 LoRA packing, seeds and token-id outputs are what the backend "
                          f"relies on); make the environment of docs/guides/vllm.md")
    if parsed[:2] > TARGET_VLLM:
        logger.warning("the server at %s runs vLLM %s; this backend was written and checked against vLLM %s",
                       url, version, target)
    return f"vllm {version}"


def same_folder(a: Optional[str], b: Optional[str]) -> bool:
    if not a or not b:
        return False
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


# ---------------------------------------------------------------------------------------------------------------
# The backend

class ServerBackend(RolloutBackend):
    """See the module docstring.

    url: a running server; or `launcher` (an object with `start(model_dir, max_model_len, max_lora_rank) -> url`,
      `stop()`, `max_model_len`, `max_lora_rank`, `model_dir`: `jaxrl.backends.vllm_backend.VLLMServer`),
      which the backend starts on first use and restarts when a model needs another folder or more room.
    out_dir: where trainer checkpoints are exported as PEFT folders for the server (`<out_dir>/peft/<name>`).
    concurrency: requests in flight at once (the server batches them).
    """

    name = "server"

    def __init__(self, base_dir: str, *, url: Optional[str] = None, launcher=None, out_dir: Optional[str] = None,
                 stop_ids: Sequence[int] = (), max_prompt_len: int = 4096, max_new_tokens: int = 4096,
                 concurrency: int = ServerOptions.concurrency,
                 request_timeout_s: float = ServerOptions.request_timeout_s,
                 progress_every_s: float = ServerOptions.progress_every_s, return_token_versions: bool = False,
                 partial: bool = False, fleet_wait_s: float = ServerOptions.fleet_wait_s):
        if (url is None) == (launcher is None):
            raise ValueError("ServerBackend needs exactly one of url (a running server) or launcher")
        self.base_dir = os.path.abspath(base_dir)
        self.url = url.rstrip("/") if url else None
        self.launcher = launcher
        self.out_dir = os.path.abspath(out_dir) if out_dir else None
        self.stop_ids = tuple(int(t) for t in stop_ids)
        self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
        self.concurrency, self.request_timeout_s = max(1, int(concurrency)), float(request_timeout_s)
        self.progress_every_s = float(progress_every_s)
        self.fleet_wait_s = float(fleet_wait_s)  # a pool of servers: how long it waits with none up (fleet.py)
        # module docstring, 'Token versions'; partial rollouts need them (a row's tokens may come from several)
        self.partial = bool(partial)
        self.return_token_versions = bool(return_token_versions) or self.partial
        self.batch_size = self.concurrency  # prompts in flight at once (each its n samples)
        self.description: Optional[str] = None  # "vllm 0.33.0" / "jaxrl 0.1.0", once connected
        self._base_name: Optional[str] = None  # the server's base model id
        self._served_root: Optional[str] = None  # the folder the server's base model was loaded from
        self._model: Optional[str] = None  # the model id requests name
        self._spec: Optional[ModelSpec] = None
        self._adapter = None
        self._adapter_digest: Optional[str] = None
        self._model_len = self.max_prompt_len + self.max_new_tokens  # what a launched server must hold
        self.base_lora_rank = 0  # a launched server on the base enables LoRA of at least this rank
        self._ours: Optional[str] = None  # an adapter this backend loaded (unloaded on switch / close)
        if self.url is not None:
            self.connect()

    # ----------------------------------------------------------------------------------------------- server
    def _get(self, path: str, timeout: float = 30.0):
        status, payload = http_json("GET", self.url + path, timeout=timeout)
        if status != 200:
            raise ServerError(f"GET {self.url}{path}: HTTP {status}: {error_message(payload)}")
        return payload

    def connect(self, timeout: float = 30.0) -> None:
        """Checks the server's version and reads which base it serves."""
        self.description = check_version(self._get("/version", timeout), self.url)
        if self.return_token_versions and not self.description.startswith(JAXRL_SERVER):
            raise ServerError(f"{self.url} ({self.description}) does not report token versions "
                              "(return_token_versions needs launchers.serve)")
        models = self._get("/v1/models", timeout).get("data") or []
        base = next((m for m in models if not m.get("parent")), None)
        if base is None:
            raise ServerError(f"{self.url}/v1/models lists no base model: {models!r}")
        self._base_name, self._served_root = base["id"], base.get("root") or base["id"]

    def models(self) -> list[dict]:
        return self._get("/v1/models").get("data") or []

    def _serve_folder(self, folder: str, max_model_len: int = 0, max_lora_rank: int = 0) -> None:
        """Makes the server serve `folder` as its base model (a launcher restarts; a URL server must already)."""
        launcher = self.launcher
        if launcher is not None:
            running = self.url is not None and same_folder(launcher.model_dir, folder)
            room = max_model_len <= launcher.max_model_len and max_lora_rank <= (launcher.max_lora_rank or 0)
            if not (running and room):
                self._ours = None
                self.url = launcher.start(folder, max(max_model_len, launcher.max_model_len),
                                          max(max_lora_rank, launcher.max_lora_rank or 0)).rstrip("/")
                self.connect()
        if not same_folder(self._served_root, folder):
            raise ServerError(f"the server at {self.url} serves {self._served_root!r}, not {folder}: start a server "
                              f"of that folder (the base of adapters, or the HF folder of kind 'hf')")

    # ------------------------------------------------------------------------------------------------- models
    def peft_folder(self, spec: ModelSpec, adapter) -> str:
        """A PEFT folder holding exactly `adapter` in the base's layout, for the server to read."""
        if is_peft_folder(spec.path):
            found, layout = read_peft_adapter(spec.path)
            if layout == layout_of(self.base_dir) and found.digest() == adapter.digest():
                return os.path.abspath(spec.path)
        if self.out_dir is None:
            raise ServerError(f"model {spec.name!r}: {spec.path} is not a PEFT folder in the base's layout; give the "
                              "backend an out_dir to export one into")
        target = os.path.join(self.out_dir, "peft", spec.name)
        info = read_provenance(target) if os.path.isdir(target) else None
        if not (info and info.get("adapter_digest") == adapter.digest() and same_folder(info.get("base"),
                                                                                        self.base_dir)):
            export_peft(adapter, target, self.base_dir, overwrite=True)
        return target

    def _unload_ours(self) -> None:
        if self._ours is not None and self.url is not None:
            status, payload = http_json("POST", self.url + "/v1/unload_lora_adapter", {"lora_name": self._ours})
            if status != 200:
                logger.warning("%s: unloading adapter %s: HTTP %s: %s", self.url, self._ours, status,
                               error_message(payload))
        self._ours = None

    def _load_adapter(self, spec: ModelSpec, adapter, folder: str) -> str:
        """The model id under which the server serves the adapter in `folder` (loading it when not listed)."""
        for card in self.models():
            if card.get("parent") and same_folder(card.get("root"), folder):
                return card["id"]
        lora_name = f"{spec.name}-{adapter.digest()[:12]}"
        status, payload = http_json("POST", self.url + "/v1/load_lora_adapter",
                                    {"lora_name": lora_name, "lora_path": folder}, timeout=600)
        if status == 404 and "not found" in error_message(payload).lower() and "lora" not in error_message(
                payload).lower():
            raise ServerError(f"{self.url} has no /v1/load_lora_adapter endpoint: start vLLM with "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (the vllm backend does), or serve the adapter "
                              f"at start-up with --enable-lora --lora-modules {spec.name}={folder}")
        if status != 200:
            raise ServerError(f"the server at {self.url} rejected adapter {spec.name!r} ({folder}): HTTP {status}: "
                              f"{error_message(payload)}")
        self._ours = lora_name
        return lora_name

    def load(self, spec: ModelSpec, adapter=None) -> None:
        """Makes `spec` the model that `generate` samples from (module docstring)."""
        if spec.kind == "hf":
            if adapter is not None:
                raise ValueError(f"model {spec.name!r}: an HF folder takes no adapter")
            self._unload_ours()
            self._serve_folder(os.path.abspath(spec.path), self._model_len)
            self._model, self._adapter_digest = self._base_name, None
        else:
            rank = lora_rank_slot(adapter.rank) if adapter is not None else 0
            self._serve_folder(self.base_dir, self._model_len, max(rank, self.base_lora_rank))
            self._unload_ours()
            if adapter is None:
                self._model, self._adapter_digest = self._base_name, None
            else:
                self._model = self._load_adapter(spec, adapter, self.peft_folder(spec, adapter))
                self._adapter_digest = adapter.digest()
        self._spec, self._adapter = spec, adapter

    def serve_adapter_version(self, lora_name: str, folder: str, adapter, *, stale_prefix: str = "",
                              in_place: bool = False) -> str:
        """Online training's adapter sync: loads the PEFT folder `folder` (holding `adapter`) as a new model
        `lora_name`, makes it what `generate` samples from, then unloads the version this backend loaded before;
        returns the digest the server reports serving under `lora_name` (`loaded_digest`), for the caller to
        compare with its own. New before old: a request in flight never finds its model gone.

        A model of the same name already listed (left by an earlier process of the same run, killed before it
        unloaded it) is unloaded first; so are, on the first call of this backend, the other models whose name
        starts with `stale_prefix` (that process's last version).

        in_place: `lora_name` is reloaded in place when this backend loaded it before (`load_inplace`: partial
        rollouts, whose requests in flight name it and continue under the new weights)."""
        self._serve_folder(self.base_dir, self._model_len, max(lora_rank_slot(adapter.rank), self.base_lora_rank))
        listed = [c["id"] for c in self.models() if c.get("parent")]
        reload = in_place and self._ours == lora_name and lora_name in listed
        stale = [n for n in listed if (n == lora_name and not reload) or (stale_prefix and self._ours is None and
                                                                          n.startswith(stale_prefix))]
        for name in stale:
            status, payload = http_json("POST", self.url + "/v1/unload_lora_adapter", {"lora_name": name})
            if status != 200:
                raise ServerError(f"the server at {self.url} lists adapter {name!r} (left by an earlier process of "
                                  f"this run) and refused to unload it: HTTP {status}: {error_message(payload)}")
        status, payload = http_json("POST", self.url + "/v1/load_lora_adapter",
                                    {"lora_name": lora_name, "lora_path": os.path.abspath(folder),
                                     **({"load_inplace": True} if reload else {})}, timeout=600)
        if status != 200:
            message = error_message(payload)
            hint = (" (launchers.serve: start it with --allowed_lora_roots=<a folder above the run's workdir>; "
                    "vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and the folder must be readable by the server at "
                    "this path)")
            raise ServerError(f"the server at {self.url} refused to load the trainer's adapter as {lora_name!r} from "
                              f"{folder}: HTTP {status}: {message}{hint}")
        previous = self._ours if self._ours not in (None, lora_name) and self._ours not in stale else None
        self._ours, self._model = lora_name, lora_name
        self._spec, self._adapter = ModelSpec(lora_name, "adapter", folder), adapter
        self._adapter_digest = adapter.digest()
        if previous is not None:
            status, payload = http_json("POST", self.url + "/v1/unload_lora_adapter", {"lora_name": previous})
            if status != 200:
                logger.warning("%s: unloading the previous adapter version %s: HTTP %s: %s", self.url, previous,
                               status, error_message(payload))
        return self.loaded_digest()

    def update_weights(self, policy: Policy) -> str:
        """Serves `policy`'s adapter (a PEFT folder written under `<out_dir>/peft/<version>`) as the model requests
        name, by `serve_adapter_version`; returns the digest the server reports serving (a pool of servers writes
        the folder once for all of them: jaxrl.backends.pool)."""
        if self.out_dir is None:
            raise ServerError("update_weights needs the backend's out_dir (where the adapter's PEFT folder is "
                              "written for the server to read)")
        adapter = policy.adapter()
        folder = os.path.join(self.out_dir, "peft", policy.version)
        export_peft(adapter, folder, self.base_dir, overwrite=True)
        return self.serve_adapter_version(policy.version, folder, adapter)

    def loaded_digest(self) -> Optional[str]:
        """Digest of the adapter the server serves under the model id requests name, from what the server reports
        (/v1/models: the digest the JAX server reads back from its parameters, else the folder it loaded)."""
        if self._adapter_digest is None:
            return None
        card = next((c for c in self.models() if c.get("id") == self._model), None)
        if card is None:
            raise ServerError(f"the server at {self.url} no longer lists model {self._model!r}")
        if card.get("adapter_digest"):
            return card["adapter_digest"]
        return read_peft_adapter(card["root"])[0].digest()

    def served_fingerprint(self) -> Optional[str]:
        """The fingerprint recorded in the served folder's jaxrl_export.json for an HF folder (a merged export);
        None otherwise (adapters are checked by `loaded_digest`)."""
        if self._spec is None or self._spec.kind != "hf":
            return None
        return (read_provenance(self._served_root) or {}).get("fingerprint")

    # --------------------------------------------------------------------------------------------- generation
    def request(self, prompt: Sequence[int], group_id: int, sampling: SamplingParams) -> dict:
        """The /v1/completions body of one prompt (module docstring). Greedy asks for one completion: vLLM refuses
        n > 1 at temperature 0 (vllm/sampling_params.py:769-773), and greedy samples are all the same one."""
        n = 1 if float(sampling.temperature) == 0.0 else int(sampling.n)
        versions = {"return_token_versions": True} if self.return_token_versions else {}
        if self.partial:  # the wire's name of the setting
            versions["partial_rollout"] = True
        return {**versions, "model": self._model, "prompt": [int(t) for t in prompt], "n": n,
                "max_tokens": int(sampling.max_new_tokens), "temperature": float(sampling.temperature),
                "top_p": float(sampling.top_p), "top_k": int(sampling.top_k),
                "seed": request_seed(sampling.seed, group_id), "stop_token_ids": list(self.stop_ids),
                "logprobs": 0, "return_token_ids": True, "ignore_eos": False, "skip_special_tokens": True,
                # explicit neutral values: a server's generation_config defaults must not change the sampling
                "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}

    def post_completion(self, body: dict, j: int) -> list[dict]:
        """The choices of one /v1/completions request (prompt `j`), checked to be the JSON of n completions."""
        status, payload = http_json("POST", self.url + "/v1/completions", body,
                                    timeout=request_timeout(body["max_tokens"], self.request_timeout_s),
                                    retries=len(RETRY_BACKOFF_S))
        if status != 200:
            raise ServerError(f"the server at {self.url} refused prompt {j} ({len(body['prompt'])} tokens, model "
                              f"{body['model']!r}): HTTP {status}: {error_message(payload)}")
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise ServerError(f"the server at {self.url} answered prompt {j} with something that is not a completion "
                              f"(HTTP 200, {len(str(payload))} characters: {str(payload)[:120]!r}...): a truncated "
                              "or garbled answer; check the server's log")
        if len(choices) != body["n"]:
            raise ServerError(f"{self.url}: prompt {j}: asked for {body['n']} completions, got {len(choices)}")
        return choices

    def requests(self, prompts, group_ids, sampling: SamplingParams) -> list[dict]:
        """The request bodies of a batch of prompts (a launched server restarted first when it needs more room)."""
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}.generate before load()")
        request_seed(sampling.seed, 0, int(sampling.n) - 1)  # bad seed / n fail before any request
        need = max(len(p) for p in prompts) + int(sampling.max_new_tokens)
        if self.launcher is not None and need > self.launcher.max_model_len:
            # a larger cap (termination re-sampling): restart with room for it, serving the same model
            self._model_len = need
            self.load(self._spec, self._adapter)
        return [self.request(p, g, sampling) for p, g in zip(prompts, group_ids)]

    def jobs(self, bodies: list[dict], first: int = 0) -> list:
        """`jaxrl.backends.waiting.send_all` jobs of these bodies (prompt numbers from `first`, for messages)."""
        return [(self.url, body["n"], functools.partial(self.post_completion, body, first + j))
                for j, body in enumerate(bodies)]

    def generations(self, results: list[list[dict]], sampling: SamplingParams, first: int = 0) -> list[Generation]:
        """The rows of the answers to `requests` (prompts numbered from `first`), prompt-major."""
        rows = []
        for j, choices in enumerate(results, start=first):
            if len(choices) < sampling.n:  # greedy: the one completion is every sample
                choices = choices * int(sampling.n)
            for i, choice in enumerate(choices):
                rows.append(self._generation(choice, j, i))
        return rows

    def generate(self, prompts, group_ids, sampling: SamplingParams) -> list[Generation]:
        bodies = self.requests(prompts, group_ids, sampling)
        results = send_all(self.jobs(bodies), concurrency={self.url: self.concurrency},
                           progress_every_s=self.progress_every_s, what=f"{len(bodies)} prompts on {self.name}")
        return self.generations(results, sampling)

    def _generation(self, choice: dict, j: int, i: int) -> Generation:
        tokens = choice.get("token_ids")
        if tokens is None:
            raise ServerError(f"{self.url}: the completion of prompt {j} carries no token_ids (the server ignored "
                              "return_token_ids; vLLM >= 0.33 returns them)")
        tokens = [int(t) for t in tokens]
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise ServerError(f"{self.url}: prompt {j} sample {i} ended with finish_reason {reason!r}")
        lp = (choice.get("logprobs") or {}).get("token_logprobs")
        logprobs = None if lp is None else [float(x) for x in lp]
        digests = self._token_digests(choice, len(tokens), j, i) if self.return_token_versions else None
        tokens, restored = with_stop_token(tokens, reason, choice.get("stop_reason"), self.stop_ids)
        if restored and digests:  # the stop id put back was sampled with the row's last weights
            digests = digests + digests[-1:]
        if restored or (logprobs is not None and len(logprobs) != len(tokens)):
            logprobs = None
        return Generation(tokens, reason, j, i, logprobs, digests)

    def _token_digests(self, choice: dict, count: int, j: int, i: int) -> list:
        """The adapter digest of each of a choice's `count` tokens (module docstring, 'Token versions')."""
        index, digests = choice.get("token_versions"), choice.get("version_digests")
        if (not isinstance(index, list) or not isinstance(digests, list) or len(index) != count
                or not all(isinstance(k, int) and 0 <= k < len(digests) for k in index)):
            raise ServerError(f"{self.url}: prompt {j} sample {i} came without a token version per token (asked "
                              "for return_token_versions; launchers.serve reports them)")
        return [digests[k] for k in index]

    def close(self) -> None:
        try:
            self._unload_ours()
        except ServerError:
            pass  # the server is gone already
        if self.launcher is not None:
            self.launcher.stop()
            self.url = None
        self._model = None


# vLLM's accepted --max-lora-rank values (vllm/config/lora.py:27, checked at adapter load, lora/peft_helper.py:194)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_slot(rank: int) -> int:
    """The smallest --max-lora-rank vLLM 0.33 accepts that holds an adapter of rank `rank`."""
    for slot in LORA_RANKS:
        if rank <= slot:
            return slot
    raise ServerError(f"LoRA rank {rank} is above vLLM 0.33's largest --max-lora-rank ({LORA_RANKS[-1]})")
