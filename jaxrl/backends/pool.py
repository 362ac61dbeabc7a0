"""A pool of servers as one backend: what online GRPO / PPO sample on with `rollout_backend` = server | vllm.

    pool = block.rollout_spec.build(BackendContext(model_path, stop_ids=(1,), max_prompt_len=64, max_new_tokens=512,
                                                   run_dir=run_dir, lora_rank=16))   # an online block's servers
    served = pool.update_weights(Policy("r7", params, lambda: policy_adapter(policy)))   # every server checked
    gens = pool.generate(prompts, group_ids, SamplingParams(n=8, max_new_tokens=512, temperature=1.0, seed=s))

The servers are a data-parallel set of engines that serve the run's base model (`model_path`): `launchers.serve`
processes or vLLM 0.33 (`rollout_servers`, or with `rollout_backend="vllm"` and no URLs one `vllm serve` the run
starts from its own environment, exactly as evaluation starts it: `jaxrl.backends.vllm_backend`). A
rollout's prompts are split over them in contiguous blocks; every sample's key is (seed, group id, sample index)
(the request seed packs it: `openai_client.request_seed`), so the split does not change a sample, and the JAX
server draws the very tokens the in-process jax backend draws for the same keys.

Adapter sync, before every rollout (`update_weights`): the trainer's current LoRA factors are written as a PEFT folder in the
base's layout to `<workdir>/rollout_adapters/<version>` (a rename of the fp32 factors: the digest survives), loaded
on every server as a new model `<run tag>-<version>` (POST /v1/load_lora_adapter), the previous version unloaded,
and the digest each server reports serving under the new name (GET /v1/models: the JAX server's `adapter_digest`,
read back from the attached parameters; vLLM's card names the folder, whose adapter is read back) compared with
the trainer's `Adapter.digest()`. A server serving anything else fails the step (`AdapterSyncError`, naming the
server). With partial rollouts (`partial=True`: `partial_rollouts`) every version is loaded under one name,
`<run tag>-live`, in place (`load_inplace`): requests in flight name it, and their rows continue under the new
version from the server's next round (each token's version comes back with it: `Generation.token_digests`); the
folders of the newest k + 1 versions stay (every version a row in flight may still sample with). The run tag is a hash of the workdir, so two runs can share servers, and a resumed run replaces the
versions its killed predecessor left loaded. The servers must be able to read the workdir at the same path
(launchers.serve: `--allowed_lora_roots` above it).

Requests ask for the sampled token's log-probability (`logprobs: 0`, temperature 1, unfiltered: the sampler's own,
as the jax backend reports them); a server that returns none fails the rollout.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shutil
import threading
from typing import Optional, Sequence

import jax
import numpy as np
from absl import logging

from jaxrl.models.peft import export_peft
from jaxrl.models import lora
from jaxrl.models.adapters import Adapter
from jaxrl.backends.base import Generation, ModelSpec, Policy, RolloutBackend, SamplingParams
from jaxrl.backends.fleet import Fleet
from jaxrl.backends.openai_client import ServerBackend, ServerError, UnreachableServer
from jaxrl.backends.waiting import send_all
from jaxrl.backends.vllm_backend import VLLMBackend, VLLMServer
from jaxrl.backends.options import VLLMLaunchOptions

ADAPTER_DIR = "rollout_adapters"  # <workdir>/rollout_adapters/<version>: the PEFT folder of the version served now
REJOIN_PROBE_S = 5.0  # a lost server's probe: a restarted one answers at once, a hung one is not waited on long
LIVE_NAME = "live"  # partial rollouts: every version is served as model `<run tag>-live`, reloaded in place


class AdapterSyncError(ServerError):
    """A rollout server that does not serve the trainer's adapter after the sync; names the server."""


def policy_adapter(model, dropout: float = 0.0) -> Adapter:
    """The LoRA factors `model` carries now, as an Adapter (host copies; its digest is what the servers must
    report)."""
    adapters = list(lora.iter_lora(model))
    if not adapters:
        raise ValueError("the policy carries no LoRA adapter to send to the rollout servers")
    first = adapters[0][1]
    params = {k: np.asarray(jax.device_get(v), np.float32) for k, v in lora.lora_state(model).items()}
    return Adapter(params=params, rank=int(first.rank), alpha=float(first.alpha), use_rslora=bool(first.use_rslora),
                   dropout=float(dropout), source="the trainer's policy")


def run_tag(workdir: str) -> str:
    """The prefix of a run's adapter names on shared servers: a hash of its workdir (stable across resumes)."""
    return "jaxrl-" + hashlib.sha256(os.path.realpath(workdir).encode()).hexdigest()[:10]


def _on_every_server(fn, backends: Sequence[ServerBackend], what: str) -> list:
    """fn(backend) for every server at once, waited for as a rollout's requests are (a SIGINT honoured, a hung
    server not joined at exit: jaxrl.backends.waiting)."""
    jobs = [(b.url or f"server {k}", 0, functools.partial(fn, b)) for k, b in enumerate(backends)]
    return send_all(jobs, concurrency={job[0]: 1 for job in jobs}, progress_every_s=backends[0].progress_every_s,
                    what=what)


class ServerPool(RolloutBackend):
    """Several servers as one backend (module docstring): `update_weights` serves the trainer's adapter on every
    server, `generate` splits the prompts over them, `load` makes every server serve one model (evaluation),
    `close` unloads this run's adapter and stops a vLLM it started. A server that stops answering is taken out and
    rejoins re-synced (module docstring, 'The fleet')."""

    name = "server"

    def __init__(self, backends: Sequence[ServerBackend], *, base_dir: str, workdir: str, partial: bool = False,
                 keep_versions: int = 1):
        if not backends:
            raise ValueError("ServerPool needs at least one server")
        self.backends = list(backends)
        self.batch_size = sum(b.batch_size for b in self.backends)
        self.base_dir = os.path.abspath(base_dir)
        self.adapter_dir = os.path.join(os.path.abspath(workdir), ADAPTER_DIR)
        self.tag = run_tag(workdir)
        self.synced: Optional[str] = None  # the trainer digest every server serves now
        # partial rollouts (module docstring): one model name for the run, reloaded in place under the rows in flight
        self.partial = bool(partial)
        # the PEFT folders of the newest versions kept (partial rollouts: k + 1, every version a row in flight may
        # still be sampling with, so any token's log-prob can be reproduced from its version's folder)
        self.keep_versions = max(1, int(keep_versions))
        self._versions: list[str] = []  # versions synced, oldest first
        # what a rejoining server must serve: (model name, PEFT folder, adapter) of the last sync
        self._serving: Optional[tuple] = None
        self._sync_lock = threading.RLock()  # a sync and a rejoin never interleave (partial: different threads)
        self._local = threading.local()  # per rollout thread: rows resent since its last fleet_metrics()
        first = self.backends[0]
        self.fleet = Fleet(len(self.backends), name=self._server_name, rejoin=self._rejoin,
                           wait_s=first.fleet_wait_s, progress_every_s=first.progress_every_s,
                           what="rollout server")

    def _server_name(self, k: int) -> str:
        return self.backends[k].url or f"server {k}"

    def urls(self) -> list[str]:
        return [b.url or f"(a {b.name} server not started yet)" for b in self.backends]

    def _up(self) -> list[int]:
        return self.fleet.up(range(len(self.backends)))

    def _each_up(self, fn, what: str) -> dict[int, object]:
        """{server: fn(backend)} over the servers up; a server lost on the way is taken out (not in the result)."""
        up = self._up()

        def guarded(b):
            try:
                return fn(b)
            except UnreachableServer as e:
                return e
        answers = _on_every_server(guarded, [self.backends[k] for k in up], what) if up else []
        out = {}
        for k, got in zip(up, answers):
            if isinstance(got, UnreachableServer):
                self.fleet.lose(k, got)
            else:
                out[k] = got
        return out

    def update_weights(self, policy: Policy) -> str:
        """Serves the policy's adapter on every server up as model `<tag>-<version>` and checks each server's digest
        (module docstring); a lost server that answers again rejoins re-synced; returns the digest they serve. The
        same adapter as the last time is only re-checked."""
        adapter, version = policy.adapter(), policy.version
        want = adapter.digest()
        name = f"{self.tag}-{LIVE_NAME if self.partial else version}"
        with self._sync_lock:
            if want == self.synced:
                served = self._each_up(lambda b: b.loaded_digest(), "adapter check")
            else:
                folder = os.path.join(self.adapter_dir, version)
                export_peft(adapter, folder, self.base_dir, overwrite=True)
                self.synced, self._serving = None, (name, folder, adapter)
                served = self._each_up(lambda b: b.serve_adapter_version(name, folder, adapter,
                                                                         stale_prefix=self.tag + "-",
                                                                         in_place=self.partial),
                                       f"adapter sync of version {version}")
            for k, got in served.items():
                if got != want:
                    backend = self.backends[k]
                    raise AdapterSyncError(
                        f"rollout server {backend.url} serves adapter digest {got} under {backend._model!r}, not the "
                        f"trainer's {want} (version {version}): another process replaced it, or the server did not "
                        "load what it was sent; the step stops rather than train on another policy's samples")
            if self.synced is None:
                self.synced = want
                self._versions = [v for v in self._versions if v != version] + [version]
                self._prune(keep=self._versions[-self.keep_versions:])
            self.fleet.try_rejoin()
        if not self._up():  # every server lost: wait (bounded) for one to come back, re-synced
            self.fleet.wait_for_one(range(len(self.backends)))
        return want

    def _rejoin(self, k: int) -> bool:
        """A lost server is back when it answers and serves the trainer's last adapter (loaded again here: a
        restarted server has none), its digest read back; a server serving another digest stays out."""
        backend = self.backends[k]
        with self._sync_lock:
            backend.connect(timeout=REJOIN_PROBE_S)
            if self._serving is None:  # nothing synced yet (evaluation, or before the first rollout)
                return True
            name, folder, adapter = self._serving
            backend._ours = None  # what it served before it was lost is gone or stale: unload by prefix
            got = backend.serve_adapter_version(name, folder, adapter, stale_prefix=self.tag + "-",
                                                in_place=self.partial)
            if got != adapter.digest():
                logging.warning("rollout server %s answers again but serves adapter digest %s, not the trainer's %s "
                                "after a re-sync: it stays out", backend.url, got, adapter.digest())
                return False
            return True

    def load(self, spec: ModelSpec, adapter=None) -> None:
        """Every server serves `spec` (each checked by its backend)."""
        _on_every_server(lambda b: b.load(spec, adapter), self.backends, f"loading {spec.name}")
        self.synced = None

    def loaded_digest(self) -> Optional[str]:
        digests = set(self._each_up(lambda b: b.loaded_digest(), "adapter check").values())
        if len(digests) > 1:
            raise AdapterSyncError(f"the rollout servers serve different adapters: {sorted(map(str, digests))}")
        return digests.pop() if digests else None

    def _prune(self, keep: Sequence[str]) -> None:
        """Removes the PEFT folders of versions not in `keep` (no server serves them any more)."""
        if not os.path.isdir(self.adapter_dir):
            return
        for name in os.listdir(self.adapter_dir):
            if name not in keep:
                shutil.rmtree(os.path.join(self.adapter_dir, name), ignore_errors=True)

    def generate(self, prompts, group_ids, sampling: SamplingParams) -> list[Generation]:
        """Prompts split over the servers up in contiguous blocks, every server's requests waited for together (one
        progress line for all of them, a SIGINT honoured: jaxrl.backends.waiting); a request whose server is lost
        goes to the next one up (the same sample keys: the same samples); rows back in prompt-major order."""
        every = list(range(len(self.backends)))
        up = self._up() or [self.fleet.wait_for_one(every)]
        blocks = [(k, idx) for k, idx in zip(up, np.array_split(np.arange(len(prompts)), len(up))) if len(idx)]
        jobs, resent = [], [0]
        for k, idx in blocks:
            backend = self.backends[k]
            bodies = backend.requests([prompts[i] for i in idx], [group_ids[i] for i in idx], sampling)
            for i, body in zip(idx, bodies):
                def call(server, i=int(i), k=k, body=body):
                    mine = body if server == k else self.backends[server].request(prompts[i], group_ids[i], sampling)
                    return self.backends[server].post_completion(mine, i)
                jobs.append((backend.url, body["n"], functools.partial(self.fleet.send, k, call, rows=body["n"],
                                                                       spread=int(i), among=every, tally=resent)))
        results = send_all(jobs, concurrency={self.backends[k].url: self.backends[k].concurrency for k, _ in blocks},
                           progress_every_s=self.backends[0].progress_every_s,
                           what=f"rollout of {len(prompts)} prompts on {len(blocks)} server(s)")
        out = []
        order = [int(i) for _, idx in blocks for i in idx]
        for i, (server, choices) in zip(order, results):
            backend = self.backends[server]
            for g in backend.generations([choices], sampling, first=i):
                if g.logprobs is None:
                    raise ServerError(f"rollout server {backend.url} returned no log-probability for the tokens of "
                                      f"prompt {g.prompt_index} (asked with logprobs: 0); online training needs the "
                                      "sampler's log-probs")
                out.append(g)
        self._local.resent = getattr(self._local, "resent", 0) + resent[0]
        return out

    def fleet_metrics(self) -> dict[str, float]:
        """`fleet/servers_up` now, and `fleet/rows_resent`: the rows this thread's `generate` calls sent to another
        server than their own since its last call (a rollout's, read once at its end)."""
        resent, self._local.resent = getattr(self._local, "resent", 0), 0
        return {"fleet/servers_up": float(self.fleet.servers_up()), "fleet/rows_resent": float(resent)}

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.synced = None


# ---------------------------------------------------------------------------------------------------- building


def vllm_server(options: VLLMLaunchOptions, *, model_path: str, dtype: str, seed: int, log_path: str,
                check_install: bool = True):
    """The `vllm serve` a run with rollout_backend='vllm' and no rollout_servers starts (evaluation's launcher,
    `jaxrl.backends.vllm_backend.VLLMServer`), with the block's `rollout_vllm` options."""
    return VLLMServer(tokenizer=os.path.abspath(model_path), dtype=dtype, seed=seed, log_path=log_path,
                      check_install=check_install, **dataclasses.asdict(options))
