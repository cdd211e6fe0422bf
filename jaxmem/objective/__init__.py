"""What a step minimises, as an object: the train step, the evaluation and the in-backward step
all call the run's objective, and none of them names a loss.

    obj = objective_of(cfg.objective)          # CausalLM() (the default), DPO, ORPO or SimPO
    counts = obj.counts(batch)                 # the step's normalisers, from its masks alone
    sums = obj.sums(model, params, batch, ...) # what depends on the weights (dict of fp32 sums)
    loss, metrics = obj.value(sums, counts)    # linear in `sums`

Linearity is what lets gradient accumulation and evaluation stay exact: the step computes
`counts` over its whole batch [K, B, T] first, and each micro-batch adds `value(sums_k, counts)`;
the evaluation adds every batch's sums and counts on the host (float64) and takes `value` once.

An objective says which batch fields it needs (`batch_keys`), which data rows it reads
(`preference`: None for the SFT rows, else the tokenization style of jaxmem.data.preference),
whether it needs the reference model's log-probs (`reference`), and `head_sums`: its sums from
the final hidden states and the head alone, which is the part the in-backward step
differentiates layer by layer (jaxmem.train.inbackward). `CausalLM` is next-token cross-entropy,
exactly today's loss (bitwise); the preference objectives are jaxmem.objective.preference.
"""

from jaxmem.objective.base import CausalLM, Objective, token_logps
from jaxmem.objective.preference import DPO, ORPO, SimPO, objective_of

__all__ = ["CausalLM", "DPO", "ORPO", "Objective", "SimPO", "objective_of", "token_logps"]
