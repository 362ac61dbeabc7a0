"""A random-init Qwen3.5 built in one jitted program (instead of one eager op per weight).

    model = init_model_jit(qwen35.tiny(), jnp.float32, seed=0, mesh=mesh)    # placed straight onto its shards
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.qwen35.config import Qwen35Config
from jaxrl.models.qwen35.model import Qwen35
from jaxrl.parallel import sharding as shd


def init_model_jit(cfg: Qwen35Config, dtype=jnp.float32, seed: int = 0, remat: str = "none", mesh=None) -> Qwen35:
    """A random-init model from one compiled program, each weight laid out by the sharding rules on `mesh`."""

    def make():
        return Qwen35(cfg, dtype=dtype, rngs=nnx.Rngs(seed), remat=remat)

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    out_sh = None if mesh is None else shd.nnx_state_shardings(abstract, mesh)
    # Runs once: on CPU a low LLVM optimisation level compiles the random-number code faster (measured in
    # benchmarks/RESULTS.md, section 'Figures formerly quoted in code comments').
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    init = jax.jit(lambda: nnx.split(make())[1], out_shardings=out_sh).lower().compile(compiler_options=options)
    return nnx.merge(graphdef, init())
