"""Wall time of an offline rollout (jaxrl.rollout.runner.run_rollouts, the path of launchers.rollout) on 1 device
vs split over 8 devices, one process.

    python -m benchmarks.bench_rollout_devices [--problems 64 --num_samples 4 --max_new_tokens 64 --batch_size 64]

On a CPU the 8 devices are fake (--xla_force_host_platform_device_count=8, set here before jax is imported) and
share the machine's cores, so this proves the plumbing and measures its overhead, not a speed-up; on a host with
8 GPUs the same command measures the real data-parallel gain. Both sides: the same tiny random model (float32,
built at start), the same problems (the toy tasks, repeated under new ids), the same compiled batch of
--batch_size rows (1 device: all of them; 8 devices: --batch_size / 8 each). Compilation is excluded: each side
runs once untimed, then the timed repeats alternate between the sides so load bursts hit both. The two outputs
must be equal token for token (a fast wrong split is not a result). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"
DEVICES = 8

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={DEVICES}").strip()


def _setup(folder: Path, problems: int, layers: int):
    import jax.numpy as jnp

    from jaxrl.data.chat import load_tokenizer
    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.config import tiny
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer

    base = [json.loads(line) for line in TASKS.read_text().splitlines()]
    rows = [dict(base[i % len(base)], id=f"{base[i % len(base)]['id']}/{i}") for i in range(problems)]
    path = folder / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in rows))
    model_dir = folder / "model"
    types = tuple("full_attention" if (i + 1) % 2 == 0 else "linear_attention" for i in range(layers))
    qwen35.save_pretrained(qwen35.init_model(tiny(num_hidden_layers=layers, layer_types=types), seed=0),
                           str(model_dir), base_dir=None, layout="container")
    build_tiny_tokenizer(str(model_dir), [m["content"] for p in rows for m in p["messages"]])
    return path, model_dir, qwen35.from_pretrained(str(model_dir), dtype=jnp.float32), load_tokenizer(str(model_dir))


def run(problems: int = 64, num_samples: int = 4, max_new_tokens: int = 64, batch_size: int = 64,
        layers: int = 2, repeats: int = 3) -> dict:
    import jax

    from jaxrl.rollout.runner import RolloutConfig, run_rollouts
    from jaxrl.utils.io import read_jsonl

    if jax.local_device_count() < DEVICES:
        raise SystemExit(f"needs {DEVICES} local devices, found {jax.local_device_count()} (XLA_FLAGS was set "
                         "before this script, without --xla_force_host_platform_device_count=8?)")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path, model_dir, model, tokenizer = _setup(folder, problems, layers)
        sides = {"1 device": (1, 1, 1), f"{DEVICES} devices": (DEVICES, 1, 1)}
        times: dict[str, list[float]] = {name: [] for name in sides}
        outputs: dict[str, list] = {}
        summaries: dict[str, dict] = {}
        for r in range(repeats + 1):  # r = 0: compiles, untimed
            for name, shape in sides.items():
                out = folder / f"{name.replace(' ', '_')}_{r}.jsonl"
                cfg = RolloutConfig(problems=str(path), model=str(model_dir), out=str(out), num_samples=num_samples,
                                    temperature=1.0, max_new_tokens=max_new_tokens, max_prompt_len=192,
                                    prompt_buckets=(192,), batch_size=batch_size, reward="exact_match", seed=0,
                                    dtype="float32", progress=False, save_logprobs=True, mesh_shape=shape)
                t0 = time.perf_counter()
                summary = run_rollouts(cfg, model=model, tokenizer=tokenizer)
                elapsed = time.perf_counter() - t0
                if r:
                    times[name].append(elapsed)
                summaries[name] = summary
                outputs[name] = [(x["problem_id"], x["sample_index"], x["token_ids"]) for x in read_jsonl(out)]
    one, many = sides
    result = {
        "benchmark": "rollout wall time, 1 vs 8 devices (one process)",
        "backend": jax.default_backend(), "devices": jax.local_device_count(), "cpu_count": os.cpu_count(),
        "problems": problems, "num_samples": num_samples, "samples": problems * num_samples,
        "max_new_tokens": max_new_tokens, "batch_size": batch_size, "layers": layers, "repeats": repeats,
        "generated_tokens": summaries[one]["generated_tokens"],
        "samples_equal_token_for_token": outputs[one] == outputs[many],
        "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    for name in sides:
        result[name] = {"median_s": round(statistics.median(times[name]), 3), "best_s": round(min(times[name]), 3),
                        "all_s": [round(t, 3) for t in times[name]], "devices_used": summaries[name]["devices"]}
    result["time_ratio_8_over_1"] = round(result[many]["median_s"] / result[one]["median_s"], 3)
    if not result["samples_equal_token_for_token"]:
        raise SystemExit(f"the 8-device rollout differs from the 1-device one: {json.dumps(result)}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--num_samples", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=64, help="rows per compiled call (a multiple of 8)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.problems, args.num_samples, args.max_new_tokens, args.batch_size, args.layers,
                         args.repeats), indent=1))


if __name__ == "__main__":
    main()
