"""The three hot kernels alone, each against its reference formulation in the same process, interleaved (so a
ratio survives a shared machine), and on an accelerator against its roofline. Prints one JSON object.

    python -m benchmarks.bench_kernels                       # CPU: small-model shapes (hidden 256)
    python -m benchmarks.bench_kernels --shape=4b            # the Qwen3.5-4B head shapes (a GPU)
    python -m benchmarks.bench_kernels --tiny                # seconds: a check that it runs

  attention      causal GQA attention fwd + bwd: `ops.attention.causal_attention` (cuDNN on a GPU with bf16,
                 else the head-major blocked XLA form) vs the dense form (fp32 [B, T, H, S] scores, a
                 materialised mask, K/V repeated to the query heads)
  gdn            Gated DeltaNet fwd + bwd: `chunk_gated_delta_rule` vs the token-by-token recurrence
  decode_update  one decode step's GDN state update: `gated_delta_decode_step` (one read, one write of the state)
                 vs the reference recurrence run for one token
  decode_projections  one decode step's projections and head (decode_batch rows against every weight of the
                 model, each weight distinct, so they come from memory as in decode): the `[in, out]` copies the
                 decode program makes on a CPU (`Qwen35.decode_weights`) vs the stored `[out, in]` layout

ratio = reference time / fast time (> 1: the fast path is faster). The roofline of each fast kernel is
max(FLOPs / peak, bytes / bandwidth) with --peak_tflops and --bandwidth (H200 defaults; ignored on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from flax import nnx

from jaxrl.models.qwen35.config import Qwen35Config, qwen35_4b, qwen35_9b, tiny
from jaxrl.models.qwen35.model import Qwen35
from jaxrl.ops.attention import causal_attention, resolve_implementation
from jaxrl.ops.gated_delta import chunk_gated_delta_rule, gated_delta_decode_step, recurrent_gated_delta_rule

from benchmarks.common import SMALL_TEXT_CONFIG, time_interleaved

H200_PEAK_BF16 = 989e12
H200_BANDWIDTH = 4.8e12

# (attention heads, kv heads, head dim, GDN key heads, value heads, key dim, value dim)
SHAPES = {"tiny": (4, 2, 16, 2, 4, 16, 16), "small": (4, 2, 64, 2, 4, 64, 64), "4b": (16, 4, 256, 16, 32, 128, 128),
          "9b": (16, 4, 256, 16, 32, 128, 128)}


def model_config(shape: str):
    """The whole model of a shape: the tests' tiny model, benchmarks.common's small one, the 4B / 9B presets."""
    if shape == "small":  # SMALL_TEXT_CONFIG's sizes; its layer pattern (every 2nd layer full) is tiny()'s
        fields = {f.name for f in dataclasses.fields(Qwen35Config)} - {"layer_types"}
        return tiny(**{k: v for k, v in SMALL_TEXT_CONFIG.items() if k in fields})
    return {"tiny": tiny, "4b": qwen35_4b, "9b": qwen35_9b}[shape]()


def weight_shapes(shape: str) -> list[tuple[int, int]]:
    """[out, in] of every projection and of the head of the shape's model (from its abstract weights)."""
    cfg = model_config(shape)
    model = nnx.eval_shape(lambda: Qwen35(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    shapes = [tuple(v.shape) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
              if path[-1] == "weight" and len(v.shape) == 2]
    return shapes if not cfg.tie_word_embeddings else shapes + [(cfg.vocab_size, cfg.hidden_size)]


def dense_attention(q, k, v, scale):
    """The reference formulation: K/V repeated, fp32 scores over every (t, s), a boolean mask."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    seq_len = q.shape[1]
    mask = jnp.tril(jnp.ones((seq_len, seq_len), bool))
    w = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", w.astype(v.dtype), v)


def _fwd_bwd(fn):
    """jit(grad) of sum(fn(...) * probe) over every float argument: one forward and one backward."""
    def loss(*args):
        out = fn(*args)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32)))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _interleave(fns: dict, args: tuple, repeats: int) -> dict:
    timed = time_interleaved({name: (lambda fn=fn: jax.block_until_ready(fn(*args))) for name, fn in fns.items()},
                             repeats=repeats)
    return {name: t["median_s"] for name, t in timed.items()}


def _roofline(seconds: float, flops: float, bytes_moved: float, peak: float, bandwidth: float) -> dict:
    bound = max(flops / peak, bytes_moved / bandwidth)
    return {"flops": flops, "bytes": bytes_moved, "achieved_tflops": flops / seconds / 1e12,
            "achieved_bandwidth_gb_s": bytes_moved / seconds / 1e9, "roofline_s": bound,
            "fraction_of_roofline": bound / seconds}


def run(shape: str = "small", batch: int = 4, seq_len: int = 1024, decode_batch: int = 8, repeats: int = 5,
        dtype: str = "auto", reference: bool = True, peak_tflops: float = H200_PEAK_BF16 / 1e12,
        bandwidth: float = H200_BANDWIDTH, tiny: bool = False) -> dict:
    if tiny:
        shape, batch, seq_len, decode_batch, repeats = "tiny", 2, 64, 4, 2
    on_cpu = jax.default_backend() == "cpu"
    dt = jnp.dtype(("float32" if on_cpu else "bfloat16") if dtype == "auto" else dtype)
    heads, kv_heads, hd, gk, gv, dk, dv = SHAPES[shape]
    peak = peak_tflops * 1e12
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    rand = lambda *s: jax.random.normal(next(keys), s, jnp.float32).astype(dt)  # noqa: E731
    item = dt.itemsize
    out = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "shape": shape, "dtype": str(dt),
           "batch": batch, "seq_len": seq_len, "repeats": repeats}

    # attention, fwd + bwd
    q, k, v = rand(batch, seq_len, heads, hd), rand(batch, seq_len, kv_heads, hd), rand(batch, seq_len, kv_heads, hd)
    scale = hd ** -0.5
    fns = {"fast": _fwd_bwd(lambda q, k, v: causal_attention(q, k, v, None, scale))}
    if reference:
        fns["reference"] = _fwd_bwd(lambda q, k, v: dense_attention(q, k, v, scale))
    t = _interleave(fns, (q, k, v), repeats)
    causal_flops = 4 * batch * heads * seq_len * seq_len * hd / 2  # QK^T and PV over the lower triangle
    a = {"implementation": resolve_implementation("auto", dt, hd), "fast_ms": 1e3 * t["fast"],
         **_roofline(t["fast"], 3.5 * causal_flops, item * batch * seq_len * hd * (2 * heads + 2 * kv_heads) * 2,
                     peak, bandwidth)}  # backward = 2.5 forwards; q, k, v, o read and their gradients written
    if reference:
        a.update(reference_ms=1e3 * t["reference"], ratio=t["reference"] / t["fast"])
    out["attention"] = a

    # Gated DeltaNet, fwd + bwd
    qg, kg, vg = rand(batch, seq_len, gk, dk), rand(batch, seq_len, gk, dk), rand(batch, seq_len, gv, dv)
    g = -jnp.abs(jax.random.normal(next(keys), (batch, seq_len, gv))) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(next(keys), (batch, seq_len, gv)))
    fns = {"fast": _fwd_bwd(lambda q, k, v: chunk_gated_delta_rule(q, k, v, g, beta))}
    if reference:
        fns["reference"] = _fwd_bwd(lambda q, k, v: recurrent_gated_delta_rule(q, k, v, g, beta))
    t = _interleave(fns, (qg, kg, vg), repeats)
    C = 64
    chunks = batch * gv * -(-seq_len // C)
    # per chunk and value head: k k^T, q k^T, the C x C inverse (~C^3/3), U, W, two state products, the output
    fwd_flops = chunks * (2 * C * C * dk * 2 + C ** 3 / 3 + 2 * C * C * (dv + dk) + 2 * 2 * C * dk * dv
                          + 2 * C * dk * dv + 2 * C * C * dv)
    gd = {"chunk_size": C, "fast_ms": 1e3 * t["fast"],
          **_roofline(t["fast"], 3 * fwd_flops, item * batch * seq_len * (2 * gk * dk + gv * dv) * 2 * 2
                      + 4 * chunks * dk * dv * 2, peak, bandwidth)}  # inputs, outputs, chunk-start states
    if reference:
        gd.update(reference_ms=1e3 * t["reference"], ratio=t["reference"] / t["fast"])
    out["gdn"] = gd

    # decode update: one token for every row against a [B, Hv, dk, dv] fp32 state
    state = jax.random.normal(next(keys), (decode_batch, gv, dk, dv), jnp.float32) * 0.1
    q1, k1, v1 = rand(decode_batch, gk, dk), rand(decode_batch, gk, dk), rand(decode_batch, gv, dv)
    g1 = -jnp.abs(jax.random.normal(next(keys), (decode_batch, gv))) * 0.1
    b1 = jax.nn.sigmoid(jax.random.normal(next(keys), (decode_batch, gv)))
    fns = {"fast": jax.jit(lambda s: gated_delta_decode_step(q1, k1, v1, g1, b1, s))}
    if reference:
        fns["reference"] = jax.jit(lambda s: recurrent_gated_delta_rule(
            q1[:, None], k1[:, None], v1[:, None], g1[:, None], b1[:, None], s))
    t = _interleave(fns, (state,), max(repeats, 20))
    state_bytes = 4 * decode_batch * gv * dk * dv
    d = {"batch": decode_batch, "fast_us": 1e6 * t["fast"],
         **_roofline(t["fast"], decode_batch * gv * dk * dv * 8, 2 * state_bytes, peak, bandwidth)}
    if reference:
        d.update(reference_us=1e6 * t["reference"], ratio=t["reference"] / t["fast"])
    out["decode_update"] = d

    # decode projections: a few rows against every weight of the model, [in, out] copies vs the stored [out, in]
    weight_key, row_key = next(keys), next(keys)
    draw = lambda key, j, s: jax.random.normal(jax.random.fold_in(key, j), s, jnp.float32).astype(dt)  # noqa: E731
    stored = [draw(weight_key, j, s) for j, s in enumerate(weight_shapes(shape))]
    rows = [draw(row_key, j, (decode_batch, w.shape[1])) for j, w in enumerate(stored)]
    copies = [w.T.copy() for w in stored]  # what decode_weights makes once per weight version
    project = lambda spec: jax.jit(lambda ws, xs: [jnp.einsum(spec, x, w) for x, w in zip(xs, ws)])  # noqa: E731
    fns = {"fast": (project("bi,io->bo"), copies)}
    if reference:
        fns["reference"] = (project("bi,oi->bo"), stored)
    timed = time_interleaved({name: (lambda fn=fn, ws=ws: jax.block_until_ready(fn(ws, rows)))
                              for name, (fn, ws) in fns.items()}, repeats=max(repeats, 20))
    weight_bytes = item * sum(w.size for w in stored)
    p = {"batch": decode_batch, "weights": len(stored), "weight_mb": weight_bytes / 1e6,
         "fast_us": 1e6 * timed["fast"]["median_s"],
         **_roofline(timed["fast"]["median_s"], 2 * decode_batch * weight_bytes / item, weight_bytes, peak,
                     bandwidth)}
    if reference:
        p.update(reference_us=1e6 * timed["reference"]["median_s"],
                 ratio=timed["reference"]["median_s"] / timed["fast"]["median_s"])
    out["decode_projections"] = p
    if on_cpu:  # a CPU has no meaningful roofline at these constants
        for name in ("attention", "gdn", "decode_update", "decode_projections"):
            for key in ("roofline_s", "fraction_of_roofline"):
                out[name].pop(key)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--decode_batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="auto", help="auto: float32 on a CPU, bfloat16 elsewhere")
    ap.add_argument("--no_reference", action="store_true", help="time the fast kernels only (large shapes)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    result = run(args.shape, args.batch, args.seq_len, args.decode_batch, args.repeats, args.dtype,
                 not args.no_reference, tiny=args.tiny)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
