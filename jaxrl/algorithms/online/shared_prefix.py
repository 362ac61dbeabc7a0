"""A group's prompt computed once, its completions branching from it (issue 51 item 2): the `shared_prefix` layout
of online rows (`<alg>.layout = "shared_prefix"`, or picked by `auto` where it pays: jaxrl/algorithms/online/layout.py).

GRPO's rows are prompt-major: rows j*n .. j*n + n - 1 are the n samples of prompt j, each padded row [P + C]
holding the prompt again. In the padded layout every teacher-forced pass (reference, old, values) and the train
step's forward + backward compute each prompt n times. Here they compute it once per group:

    arrays, metrics = OnlineLayout("shared_prefix", width=C).apply(arrays, group=8)  # + prefix_rows [N, n]
    next_token_logprobs(model, ids, mask, start=P - 1, prefix_group=n)             # [b, C], as padded

The design (`Qwen35.branched_hidden_states`, called by jaxrl.models.teacher_forced.shared_prefix_hidden), chosen
because it is the model's own prefill -> continue path, which the generation engine already relies on (a prefix
followed by a continuation equals one pass: jaxrl/models/qwen35/model.py), so no new kernel. Layer by layer:
  1. the G = b / n prompts [G, P] run as a prefill (the fused causal attention over the prompt), which gives the
     keys / values (attention layers) and the conv window + recurrent state (Gated DeltaNet layers) after the
     prompt's real tokens. Left padding leaves the states as they were: the layer zeroes padded inputs before
     the conv and the delta rule (zero keys write nothing, and a zero state decays to zero), and RoPE positions
     count real tokens only;
  2. those states, `jnp.repeat`ed n times (`repeat_rows`), are continued by the n completions [G*n, C]:
     attention over the prompt's keys and the completion's own (`continuation_attention`: causal query blocks,
     each recomputed in the backward, so one block's scores live at a time), the chunked delta rule from the
     prompt's state, the conv from the prompt's last K-1 inputs. Completion token 0 is predicted by the prompt's
     last hidden state, token t by the continuation's t - 1.
Each layer (both halves) is one `jax.checkpoint` under the remat policy a padded pass over the rows would run, and
the layers are scanned over the repeats of the pattern when the training forward scans: the backward keeps the
prompts' and the completions' hidden states per layer and recomputes the rest, so the step's memory is the padded
step's or less (benchmarks/RESULTS.md, the AOT table of issue 51). Plain jnp end to end, so the train step
differentiates through it: the transpose of the repeat sums the n branches' cotangents into the prompt's
activations, and LoRA applies as in any pass (the same `Linear` modules, adapters on or off by
`adapters_disabled`). Per-token log-probs, the loss and every LoRA gradient equal the padded layout's within float32
rounding (tests/test_shared_prefix.py).

Alternatives not taken: (a) one packed row per group, prompt then the n completions end to end with a
tree-shaped attention mask: attention could share the prompt, but the Gated DeltaNet recurrence is a chain, so
each completion would need its state reset to the prompt's mid-row (a new segment rule in the chunked kernel and
the conv); (b) sharing only the attention layers' keys: the GDN and MLP layers, most of the compute, would still
run n times.

Limits: the continuation's attention is the XLA form (query blocks) on every backend, not cuDNN's fused kernel (its
mask types do not express "the prompt's valid keys, then causal"); it reads the repeated prompt keys ([G*n, P + C]
per attention layer, as padded); `gdn_state_dtype` other than float32 rounds the prompt's state once (the padded
pass does not). Rows must come prompt-major in whole groups per call / micro-batch: the layout finds n in the rows
(`prefix_group`) and falls back to padded (logged) when no aligned block shares a prompt. With several minibatches
per rollout, GRPO and PPO under this layout (or auto, for prompts it weighs it for) permute whole groups
(`layout.keeps_groups`, jaxrl/algorithms/online/buffer.py `Schedule.group`), so minibatches keep them; a micro-batch
that is not a multiple of the group still shares within its aligned blocks. On a mesh the prompts (every n-th row)
are gathered across the rows' shards.
"""

from jaxrl.algorithms.online.layout import SHARED_KEYS, is_shared, prefix_group  # noqa: F401
from jaxrl.models.qwen35.model import repeat_rows  # noqa: F401
from jaxrl.models.teacher_forced import shared_prefix_hidden  # noqa: F401
