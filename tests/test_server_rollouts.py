"""Online GRPO with its rollouts sampled on servers (`grpo.rollout_backend='server'`, jaxrl.backends.pool)
over loopback, two real `launchers.serve` processes as the data-parallel set: the same rollouts, token for token, as
the in-process jax backend for the same keys; the trainer's adapter fingerprint served at every rollout (and a
replaced one refused by name); a SIGKILL plus resume bit-exact, with and without overlap (one rollout off-policy),
whose rollouts differ from the plain run's by the one-rollout lag only. Plus the config checks and the `vllm serve`
command a run with rollout_backend='vllm' starts (vLLM itself cannot run here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serve_fixture import Served, build_base

ROOT = Path(__file__).resolve().parents[1]
PROMPT_BUCKET = 32  # the trainer's one prompt length for the token task's 6-token prompts (MIN_PROMPT_BUCKET)
SLOTS = 8  # rows decoded at once, trainer and servers alike: every sampler program has the same shapes
STEPS, EVERY = 6, 2  # 3 rollouts of 2 steps each (num_iterations=2), a checkpoint at each rollout's start


def overrides(base: str, servers=(), backend="jax", overlap=False) -> list[str]:
    """configs/grpo_tiny.py on the served base: 8 prompts x 8 samples a rollout, two passes over each (so every
    rollout lands in rollouts/<r>.npz, kept: KEEP_ALL), a checkpoint at every rollout's start."""
    args = [f"--config.model_path={base}", f"--config.steps={STEPS}", f"--config.checkpoint_every={EVERY}",
            "--config.tensorboard=False", "--config.checkpoint_async=False",
            "--config.grpo.num_iterations=2", f"--config.grpo.rollout_batch_size={SLOTS}",
            f"--config.grpo.rollout_backend={backend}", f"--config.grpo.overlap={overlap}"]
    if servers:
        args.append(f"--config.grpo.rollout_servers=({', '.join(repr(u) for u in servers)},)")
    return args


# configs/grpo_tiny.py keeping every training state, so no rollout buffer is pruned (None cannot be a flag value)
KEEP_ALL = """from configs import grpo_tiny


def get_config():
    c = grpo_tiny.get_config()
    c.keep_checkpoints = None
    return c
"""


def train(workdir, cache, *args, kill_after: int = 0) -> subprocess.CompletedProcess:
    from launcher_env import launch_env
    config = Path(cache).parent / "grpo_keep_all.py"
    if not config.exists():
        config.write_text(KEEP_ALL)
    cmd = [sys.executable, "-m", "launchers.train", f"--config={config}", f"--workdir={workdir}", *args]
    if kill_after:
        cmd.append(f"--debug_kill_after_step={kill_after}")
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(cache), capture_output=True, text=True, timeout=900)


def metrics(workdir) -> list[dict]:
    from jaxrl.train.metrics import read_metrics
    return read_metrics(str(workdir))


def rollout_buffer(workdir, r: int) -> dict:
    from jaxrl.algorithms.online.buffer import RolloutStore
    arrays, meta = RolloutStore(str(workdir)).load(r)
    return {**arrays, "meta": meta}


def served_adapters(url: str) -> list[str]:
    from jaxrl.backends.openai_client import http_json
    return [m["id"] for m in http_json("GET", url + "/v1/models")[1]["data"] if m.get("parent")]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_rollouts")
    base = build_base(root / "base")
    flags = (f"--allowed_lora_roots={root}", f"--max_prompt_len={PROMPT_BUCKET}",
             f"--prompt_buckets={PROMPT_BUCKET}", f"--batch_size={SLOTS}", "--max_model_len=128")
    servers = [Served(root, base, *flags, name=f"serve{k}") for k in range(2)]
    yield {"root": root, "base": base, "urls": [s.url for s in servers], "cache": root / "jax_cache",
           "servers": servers}
    for s in servers:
        s.stop()


# ------------------------------------------------------------------------------------------------- the engine


@pytest.mark.heavy
def test_server_rollouts_equal_the_jax_backend_and_serve_the_trainers_adapter(env, tmp_path):
    """One Rollouts per backend on the same policy: the servers' rows are the jax backend's token for token
    (log-probs to 1e-5), the rows split over both servers; each rollout serves the trainer's current adapter
    (digest read back by the server), a new adapter changes the rows on both backends alike, and a server whose
    adapter another process replaced fails the rollout naming that server."""
    import jax.numpy as jnp

    from jaxrl.algorithms.online.rollouts import Rollouts as RolloutEngine
    from jaxrl.algorithms.run import build_model, resolve_config
    from jaxrl.backends.pool import AdapterSyncError, policy_adapter
    from jaxrl.models.peft import export_peft
    from jaxrl.models.lora import iter_lora
    from jaxrl.parallel.mesh import make_mesh
    from jaxrl.backends.openai_client import http_json
    from conftest import tiny_config

    def config(backend, servers=()):
        c = tiny_config("grpo", rollout_batch_size=SLOTS, rollout_backend=backend, rollout_servers=tuple(servers))
        c.model_path = env["base"]
        return resolve_config(c)

    cfg = config("jax")
    model = build_model(cfg)
    mesh = make_mesh((1, 1, 1))
    jax_engine = RolloutEngine(cfg, model, mesh, prompts_per_rollout=8, sampling=cfg.grpo)
    server_engine = RolloutEngine(config("server", env["urls"]), model, mesh, prompts_per_rollout=8,
                                  sampling=config("server", env["urls"]).grpo)
    jax_engine.open(str(env["root"] / "jax_run"), model)
    server_engine.open(str(env["root"] / "engine_run"), model)

    def same(a, b):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
        np.testing.assert_array_equal(a.rewards, b.rewards)
        np.testing.assert_allclose(a.behaviour_logp, b.behaviour_logp, rtol=0, atol=1e-5)

    outs = {}
    for step, rollouts in enumerate(((0, 1), (2, 0))):
        if step:  # a trained-looking adapter: every LoRA B factor random (they start at 0)
            rng = np.random.default_rng(step)
            for _, lo in iter_lora(model):
                lo.lora_B[...] = jnp.asarray(0.3 * rng.standard_normal(lo.lora_B.shape), jnp.float32)
        want = policy_adapter(model).digest()
        for r in rollouts:
            a, b = jax_engine.run(model, r), server_engine.run(model, r)
            same(b, a)
            assert b.adapter == {"rollout/adapter_digest": want, "rollout/served_digest": want,
                                 "rollout/servers": 2.0}
            outs[step, r] = a.input_ids
        # one version per adapter (the same adapter again is only re-checked), the older ones unloaded
        names = [served_adapters(u) for u in env["urls"]]
        version = f"r{rollouts[0]}"
        assert names[0] == names[1] and len(names[0]) == 1 and names[0][0].endswith("-" + version)
        assert os.listdir(env["root"] / "engine_run" / "rollout_adapters") == [version]
    assert not np.array_equal(outs[0, 0], outs[1, 0])  # the adapter changed the rows

    # another process replaces the served adapter under our name: the next rollout stops, naming the server
    other = env["root"] / "other_adapter"
    export_peft(policy_adapter(build_model(cfg)), str(other), env["base"], overwrite=True)
    status, _ = http_json("POST", env["urls"][1] + "/v1/load_lora_adapter",
                          {"lora_name": names[1][0], "lora_path": str(other), "load_inplace": True})
    assert status == 200
    with pytest.raises(AdapterSyncError, match=env["urls"][1].replace(".", r"\.")):
        server_engine.run(model, 1)
    server_engine.close()
    assert served_adapters(env["urls"][0]) == served_adapters(env["urls"][1]) == []


# ------------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def runs(env):
    """The plain server run and the jax run of the same config, each uninterrupted."""
    root, cache = env["root"], env["cache"]
    out = {}
    for name, args in (("server", overrides(env["base"], env["urls"], "server")),
                       ("jax", overrides(env["base"]))):
        proc = train(root / name, cache, *args)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[name] = root / name
    return out


def assert_same_run(a, b, check_buffers=True, steps=STEPS):
    """Bit-identical training: the losses, norms and rewards of every step, the adapters of every checkpoint,
    and (check_buffers) every rollout's tokens and old / reference log-probs."""
    from jaxrl.models.adapters import adapter_steps, load_adapter
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(1, steps + 1))
    for key in ("loss", "grad_norm", "lora_norm", "reward/mean", "advantage/abs_mean"):
        assert [r[key] for r in ma] == [r[key] for r in mb], key
    assert adapter_steps(str(a)) == adapter_steps(str(b)) == list(range(EVERY, steps + 1, EVERY))
    for step in adapter_steps(str(a)):
        pa, pb = load_adapter(str(a), step)[0], load_adapter(str(b), step)[0]
        for name in pa:
            np.testing.assert_array_equal(pa[name], pb[name], err_msg=f"{name} step {step}")
    if check_buffers:
        for r in range(steps // EVERY):
            ba, bb = rollout_buffer(a, r), rollout_buffer(b, r)
            for key in ("input_ids", "attention_mask", "completion_mask", "advantages", "old_logp", "ref_logp"):
                np.testing.assert_array_equal(ba[key], bb[key], err_msg=f"rollout {r} {key}")


@pytest.mark.heavy
def test_grpo_on_servers_trains_exactly_as_on_the_jax_backend(runs):
    """Same config, rollout_backend server (two servers) vs jax: every rollout's rows token for token, hence the
    whole run bit-identical."""
    assert_same_run(runs["server"], runs["jax"])
    assert np.any(rollout_buffer(runs["server"], 0)["completion_mask"].sum(1) < 8)  # some rows stop early


@pytest.mark.heavy
def test_the_served_adapter_is_the_trainers_at_every_rollout(runs, env):
    """metrics.jsonl logs, at every rollout, the trainer's adapter digest and the one both servers reported serving:
    equal, and equal to the digest of the adapter checkpoint of the step the rollout was sampled at. After the
    last rollout no adapter of the run stays loaded."""
    from jaxrl.models.peft import read_adapter
    by_rollout = {}
    for r in metrics(runs["server"]):
        assert r["rollout/served_digest"] == r["rollout/adapter_digest"]
        assert r["rollout/servers"] == 2.0
        by_rollout.setdefault(int(r["rollout"]), r)
    assert sorted(by_rollout) == [0, 1, 2] and len({r["rollout/adapter_digest"] for r in by_rollout.values()}) == 3
    for rollout, r in by_rollout.items():
        step = int(r["rollout/policy_step"])
        assert step == EVERY * rollout and r["rollout/staleness"] == 0.0
        if step:  # step 0's adapter (the LoRA init) has no checkpoint
            assert read_adapter(str(runs["server"]), step).digest() == r["rollout/adapter_digest"]
    assert not any(m.startswith("jaxrl-") for u in env["urls"] for m in served_adapters(u))


@pytest.mark.heavy
def test_server_run_killed_and_resumed_is_bit_exact(runs, env):
    """SIGKILL after step 3 (inside rollout 1), resume from the checkpoint of step 2: the resumed process sends its
    restored adapter before rollout 1 and ends bit-identical to the uninterrupted run."""
    work = env["root"] / "server_killed"
    args = overrides(env["base"], env["urls"], "server")
    first = train(work, env["cache"], *args, kill_after=3)
    assert first.returncode == -9, first.stderr[-3000:]
    assert any(m.endswith("-r1") for m in served_adapters(env["urls"][0]))  # the killed process left it loaded
    second = train(work, env["cache"], *args)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "(step 2)" in second.stderr
    assert_same_run(work, runs["server"])
    resumed = [r for r in metrics(work) if r["step"] == 3][0]
    assert resumed["rollout/served_digest"] == [r for r in metrics(runs["server"])
                                                if r["step"] == 3][0]["rollout/served_digest"]
    assert not any(m.startswith("jaxrl-") for u in env["urls"] for m in served_adapters(u))


@pytest.mark.heavy
def test_overlap_lags_one_rollout_and_resumes_bit_exact(runs, env):
    """grpo.overlap: rollout r >= 1 is sampled from the parameters of rollout r - 1's first step while that one
    trains. Its rows are exactly what the plain engine samples for rollout r from those parameters, the first
    rollout's steps equal the plain run's, staleness is logged; and a SIGKILL plus resume is bit-exact (the
    rollout in flight at the checkpoint was written with it)."""
    from jaxrl.algorithms.online.rollouts import Rollouts as RolloutEngine
    from jaxrl.algorithms.run import build_model, resolve_config
    from jaxrl.models.adapters import load_adapter
    from jaxrl.models.lora import iter_lora
    from jaxrl.parallel.mesh import make_mesh
    from conftest import tiny_config

    args = overrides(env["base"], env["urls"], "server", overlap=True)
    straight, killed = env["root"] / "overlap", env["root"] / "overlap_killed"
    proc = train(straight, env["cache"], *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lagged, plain = metrics(straight), metrics(runs["server"])
    assert [r["rollout/policy_step"] for r in lagged] == [0, 0, 0, 0, 2, 2]
    assert [r["rollout/staleness"] for r in lagged] == [0, 1, 2, 3, 2, 3]
    assert [r["loss"] for r in lagged[:2]] == [r["loss"] for r in plain[:2]]  # rollout 0: the same
    assert [r["loss"] for r in lagged[2:]] != [r["loss"] for r in plain[2:]]

    # rollout r of the overlapped run = the plain engine's rollout r from the parameters of step 2 (r - 1)
    c = tiny_config("grpo", rollout_batch_size=SLOTS, num_iterations=2)
    c.model_path = env["base"]
    cfg = resolve_config(c)
    model = build_model(cfg)
    engine = RolloutEngine(cfg, model, make_mesh((1, 1, 1)), prompts_per_rollout=8, sampling=cfg.grpo)
    engine.open(str(env["root"] / "plain_engine"), model)
    np.testing.assert_array_equal(engine.run(model, 1).input_ids, rollout_buffer(straight, 1)["input_ids"])
    params = load_adapter(str(straight), 2)[0]  # the parameters of step 2, in place
    for path, lo in iter_lora(model):
        lo.lora_A[...], lo.lora_B[...] = params[path + ".lora.lora_A"], params[path + ".lora.lora_B"]
    np.testing.assert_array_equal(engine.run(model, 2).input_ids, rollout_buffer(straight, 2)["input_ids"])

    first = train(killed, env["cache"], *args, kill_after=3)
    assert first.returncode == -9, first.stderr[-3000:]
    second = train(killed, env["cache"], *args)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed inside rollout 1: loaded" in second.stderr  # sampled from step 0's parameters, read back
    assert_same_run(killed, straight)


@pytest.mark.heavy
def test_max_staleness_two_samples_two_rollouts_ahead_and_resumes_bit_exact(runs, env):
    """grpo.max_staleness=2: at rollout 0's first step the producer samples rollouts 1 and 2 from step 0's
    parameters, so they train 1 and 2 versions behind (logged per step, never above the bound); a SIGKILL inside
    rollout 1 and a resume read both back from the buffer store (the checkpoint waited for them) and end
    bit-identical to the uninterrupted run."""
    args = overrides(env["base"], env["urls"], "server") + ["--config.grpo.max_staleness=2"]
    straight, killed = env["root"] / "staleness2", env["root"] / "staleness2_killed"
    proc = train(straight, env["cache"], *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ahead, plain = metrics(straight), metrics(runs["server"])
    assert [r["rollout/policy_step"] for r in ahead] == [0] * STEPS
    assert [r["rollout/staleness_max"] for r in ahead] == [0, 0, 1, 1, 2, 2]
    assert max(r["rollout/staleness_max"] for r in ahead) <= 2 and all(r["rollout/dropped_stale"] == 0 for r in ahead)
    assert all(r["time/trainer_idle_s"] >= 0 for r in ahead if "time/trainer_idle_s" in r)
    assert [r["loss"] for r in ahead[:2]] == [r["loss"] for r in plain[:2]]  # rollout 0: the same
    first = train(killed, env["cache"], *args, kill_after=3)
    assert first.returncode == -9, first.stderr[-3000:]
    second = train(killed, env["cache"], *args)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed inside rollout 1: loaded" in second.stderr and "resumed inside rollout 2: loaded" in second.stderr
    assert_same_run(killed, straight)


@pytest.mark.heavy
def test_the_decoupled_objective_clips_against_the_proximal_policy_and_resumes_bit_exact(runs, env):
    """grpo.off_policy_loss='decoupled' with max_staleness=2: at each rollout's first step the old log-probs are
    the current (proximal) parameters' own, so that step's ratio is 1 (|ratio - 1| at fp32 rounding) however
    stale the rollout, while the behaviour policy enters as the weight proximal / sampler (away from 1 on the
    rollouts sampled 1 and 2 versions ago, 1 up to numerics on the first); a SIGKILL inside rollout 1 resumes
    bit-exact (the proximal log-probs were written back with the rollout)."""
    args = overrides(env["base"], env["urls"], "server") + ["--config.grpo.max_staleness=2",
                                                             "--config.grpo.off_policy_loss=decoupled"]
    straight, killed = env["root"] / "decoupled", env["root"] / "decoupled_killed"
    proc = train(straight, env["cache"], *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = metrics(straight)
    firsts = [r for r in steps if r["step"] % EVERY == 1]  # each rollout's first step (2 steps a rollout)
    assert all(r["ratio_abs_dev"] < 1e-5 for r in firsts), [r["ratio_abs_dev"] for r in firsts]
    spread = [r["offpolicy/is_weight_max"] - r["offpolicy/is_weight_min"] for r in firsts]
    # rollout 0 is on-policy (the weights are 1 up to fp32 numerics); 1 and 2 were sampled 1 and 2 versions ago
    assert spread[0] < 1e-4 and min(spread[1:]) > 10 * max(spread[0], 1e-6), spread
    assert all(np.isfinite(r["loss"]) for r in steps) and not any(r["update_skipped"] for r in steps)
    first = train(killed, env["cache"], *args, kill_after=3)
    assert first.returncode == -9, first.stderr[-3000:]
    second = train(killed, env["cache"], *args)
    assert second.returncode == 0, second.stderr[-4000:]
    assert_same_run(killed, straight)


# ------------------------------------------------------------------------------------------------- settings


def test_rollout_backend_settings_are_checked():
    from conftest import tiny_config
    from jaxrl.algorithms.run import resolve_config

    def resolve(**block):
        return resolve_config(tiny_config("grpo", **block))

    assert resolve().grpo.rollout_backend == "jax"
    got = resolve(rollout_backend="server", rollout_servers=("http://127.0.0.1:8000/", "http://127.0.0.1:8001"))
    assert got.grpo.rollout_servers == ("http://127.0.0.1:8000", "http://127.0.0.1:8001")
    for block, message in (
            (dict(rollout_backend="sglang"), "choose one of"),
            (dict(rollout_backend="server"), "needs grpo.rollout_servers"),
            (dict(rollout_servers=("http://127.0.0.1:8000",)), "rollout_backend is 'jax'"),
            (dict(rollout_backend="server", rollout_servers=("127.0.0.1:8000",)), "not base URLs"),
            (dict(overlap=True), "needs grpo.rollout_backend='server' or 'vllm'"),
            (dict(max_staleness=2), "needs grpo.rollout_backend='server' or 'vllm'"),
            (dict(rollout_backend="vllm", max_staleness=-1), "max_staleness must be >= 0"),
            (dict(rollout_backend="vllm", overlap=True, max_staleness=3), "overlap is max_staleness=1"),
            (dict(rollout_backend="vllm", off_policy_loss="decoupled"), "needs grpo.max_staleness >= 1"),
            (dict(rollout_backend="server", rollout_servers=("http://a:1",), rollout_vllm={"python": "x"}),
             r"grpo.rollout_vllm.python: launch options of the vLLM a run starts"),
            (dict(rollout_server={"concurrency": 8}), r"grpo.rollout_server.concurrency are for rollout_backend"),
            (dict(rollout_backend="vllm", rollout_server={"concurency": 8}),
             r"unknown config key 'grpo.rollout_server.concurency'; did you mean 'grpo.rollout_server.concurrency'"),
            (dict(rollout_backend="vllm", rollout_backend_kwargs={"gpu_util": 0.5}),
             r"unknown config key 'grpo.rollout_backend_kwargs.gpu_util'"),
            (dict(rollout_backend="vllm", rollout_backend_kwargs={"concurrency": 8}, rollout_server={"concurrency": 16}),
             "disagree; set grpo.rollout_server.concurrency only")):
        with pytest.raises(ValueError, match=message):
            resolve(**block)
    ppo = tiny_config("ppo", rollout_backend="vllm", overlap=True,
                      rollout_vllm={"data_parallel_size": 2}, rollout_server={"concurrency": 8})
    typed = resolve_config(ppo).ppo
    assert typed.overlap and typed.rollout_vllm.data_parallel_size == 2 and typed.rollout_server.concurrency == 8
    assert typed.max_staleness == 1  # overlap is the alias of one rollout ahead
    ahead = resolve(rollout_backend="vllm", max_staleness=3).grpo
    assert ahead.max_staleness == 3
    # the deprecated dict still works: its keys land in the typed blocks, with one warning naming their new keys
    legacy = tiny_config("ppo", rollout_backend="vllm", overlap=True,
                         rollout_backend_kwargs={"data_parallel_size": 2, "concurrency": 8})
    with pytest.warns(FutureWarning, match=r"ppo.rollout_backend_kwargs is deprecated: set "
                      r"ppo.rollout_server.concurrency, ppo.rollout_vllm.data_parallel_size instead"):
        migrated = resolve_config(legacy)
    assert migrated.ppo == typed
    assert migrated.to_json()["ppo"]["rollout_backend_kwargs"] == {}  # config.json holds the typed form


def test_a_config_json_written_with_rollout_backend_kwargs_resumes_with_the_same_options():
    """A run started before the typed blocks wrote its options into rollout_backend_kwargs; reading that
    config.json back gives the block a run with the typed keys gets."""
    from jaxrl.algorithms.run import resolve_config
    from jaxrl.algorithms.tasks import default_config
    old = default_config("grpo").to_dict()
    old["grpo"].update(rollout_backend="vllm", rollout_backend_kwargs={"request_timeout_s": 60, "max_loras": 2})
    del old["grpo"]["rollout_server"], old["grpo"]["rollout_vllm"]  # keys its writer did not have
    with pytest.warns(FutureWarning):
        got = resolve_config(json.loads(json.dumps(old))).grpo
    assert got.rollout_server.request_timeout_s == 60.0 and isinstance(got.rollout_server.request_timeout_s, float)
    assert got.rollout_vllm.max_loras == 2 and got.rollout_backend_kwargs == {}


def test_server_rollouts_need_a_base_folder():
    """A preset model exists only in the trainer: the servers could not serve it."""
    from conftest import tiny_config
    from jaxrl.algorithms.run import build_model, resolve_config
    from jaxrl.algorithms.grpo_task import GRPOTask
    from jaxrl.parallel.mesh import make_mesh
    cfg = resolve_config(tiny_config("grpo", rollout_backend="server", rollout_servers=("http://127.0.0.1:9",)))
    with pytest.raises(ValueError, match="set model_path"):
        GRPOTask(cfg, build_model(cfg), make_mesh((1, 1, 1)))


def test_vllm_rollout_servers_are_started_as_evaluation_starts_them(tmp_path):
    """rollout_backend='vllm' without URLs: one `vllm serve` of the base from the vLLM environment with LoRA of the
    run's rank, the run's seed and dtype, room for a prompt and its completion, and the launch options of
    rollout_vllm; its log in the workdir. (vLLM itself does not run here: the command is checked.)"""
    from conftest import tiny_config
    from jaxrl.algorithms.run import resolve_config
    from jaxrl.backends.settings import BackendContext
    c = tiny_config("grpo", rollout_backend="vllm", rollout_server={"concurrency": 16}, rollout_vllm={
        "python": sys.executable, "data_parallel_size": 2, "gpu_memory_utilization": 0.5,
        "extra_args": ["--enforce-eager"]})
    c.model_path = str(tmp_path / "base")
    c.seed = 3
    cfg = resolve_config(c)
    pool = cfg.grpo.rollout_spec.build(BackendContext(
        cfg.model_path, stop_ids=(1,), max_prompt_len=32, max_new_tokens=8, dtype=cfg.dtype, seed=cfg.seed,
        run_dir=str(tmp_path / "run"), lora_rank=cfg.lora.rank, check_install=False))
    (backend,) = pool.backends
    assert backend.name == "vllm" and backend.url is None and backend.concurrency == 16  # started at first sync
    assert backend.base_lora_rank == cfg.lora.rank
    launcher = backend.launcher
    assert launcher.log_path == str(tmp_path / "run" / "vllm_server.log")
    argv = launcher.command(cfg.model_path, 32 + 8, max(cfg.lora.rank, backend.base_lora_rank), port=1234)
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", cfg.model_path]
    flags = {a: (b if not b.startswith("--") else None) for a, b in zip(argv[5:], argv[6:] + [""])
             if a.startswith("--")}
    assert flags["--dtype"] == "float32" and flags["--seed"] == "3" and flags["--max-model-len"] == "40"
    assert flags["--max-lora-rank"] == "8" and flags["--data-parallel-size"] == "2"
    assert flags["--gpu-memory-utilization"] == "0.5" and flags["--generation-config"] == "vllm"
    assert flags["--api-server-count"] == "1" and "--enable-lora" in flags and argv[-1] == "--enforce-eager"
    assert flags["--tokenizer"] == cfg.model_path and flags["--port"] == "1234"
    assert json.dumps(argv)  # plain strings: what Popen gets
