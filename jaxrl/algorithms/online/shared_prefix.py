"""A group's prompt computed once, its completions branching from it (issue 51 item 2): the `shared_prefix` layout
of online rows (`<alg>.layout = "shared_prefix"`, opt-in; `auto` does not pick it).

GRPO's rows are prompt-major: rows j*n .. j*n + n - 1 are the n samples of prompt j, each padded row [P + C]
holding the prompt again. In the padded layout every teacher-forced pass (reference, old, values) and the train
step's forward + backward compute each prompt n times. Here they compute it once per group:

    arrays, metrics = OnlineLayout("shared_prefix", width=C).apply(arrays, group=8)  # + prefix_rows [N, n]
    next_token_logprobs(model, ids, mask, start=P - 1, prefix_group=n)             # [b, C], as padded

The design (jaxrl.models.teacher_forced.shared_prefix_hidden), chosen because it is the model's own prefill ->
continue path, which the generation engine already relies on (a prefix followed by a continuation equals one pass:
jaxrl/models/qwen35/model.py), so no model code changes and no new kernel:
  1. the G = b / n prompts [G, P] run `Qwen35.hidden_states(..., cache_length=P + C)`, which returns per layer the
     keys / values (attention layers) and the conv window + recurrent state (Gated DeltaNet layers) after the
     prompt's real tokens. Left padding leaves the states as they were: the layer zeroes padded inputs before
     the conv and the delta rule (zero keys write nothing, and a zero state decays to zero), and RoPE positions
     count real tokens only;
  2. that cache, `jnp.repeat`ed n times (`repeat_cache`), is continued by the n completions [G*n, C]
     (`hidden_states(..., cache=)`): attention over the prompt's keys and the completion's own (`cache_attention`),
     the chunked delta rule from the prompt's state, the conv from the prompt's last K-1 inputs. Completion token
     0 is predicted by the prompt's last hidden state, token t by the continuation's t - 1.
Both calls are one jitted function, plain jnp end to end, so the train step differentiates through them: the
transpose of the repeat sums the n branches' cotangents into the prompt's activations, and LoRA applies as in any
pass (the same `Linear` modules, adapters on or off by `adapters_disabled`). Per-token log-probs, the loss and
every LoRA gradient equal the padded layout's within float32 rounding (tests/test_shared_prefix.py).

Alternatives not taken: (a) one packed row per group, prompt then the n completions end to end with a
tree-shaped attention mask: attention could share the prompt, but the Gated DeltaNet recurrence is a chain, so
each completion would need its state reset to the prompt's mid-row (a new segment rule in the chunked kernel and
the conv); (b) sharing only the attention layers' keys: the GDN and MLP layers, most of the compute, would still
run n times.

Limits: the two calls run the model's cache paths, unscanned and without remat (activation memory of a train
step as remat "none"); the continuation's attention reads the repeated prompt keys ([G*n, P + C] per attention
layer, as padded); `gdn_state_dtype` other than float32 rounds the prompt's state once (the padded pass does
not). Rows must come prompt-major in whole groups per call / micro-batch: the layout finds n in the rows
(`prefix_group`) and falls back to padded (logged) when no aligned block shares a prompt, e.g. a train step whose
minibatch rows are a permutation of the rollout (several minibatches per rollout). On a mesh the prompts (every
n-th row) are gathered across the rows' shards.
"""

from jaxrl.algorithms.online.layout import SHARED_KEYS, is_shared, prefix_group  # noqa: F401
from jaxrl.models.teacher_forced import repeat_cache, shared_prefix_hidden  # noqa: F401
