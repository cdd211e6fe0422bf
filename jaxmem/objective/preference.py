"""Preference objectives: DPO, ORPO and SimPO, computed as TRL 1.16 computes them.

A preference batch (jaxmem.data.preference) holds B pairs as 2B rows: row 2i is pair i's chosen
sequence, row 2i + 1 its rejected one, each prompt + completion; `mask` marks the completion's
targets (the prompt is never trained), `real` every real target (ORPO's NLL). A padding pair
(the eval's last batch) has an empty mask and counts nowhere. From each row's target
log-probabilities (fused with the head: jaxmem.objective.base.token_logps, no [B, T, V] logits)
the objectives take per-sequence sums over the completion, pi_c and pi_r:

    DPO    loss = -log sigmoid(beta z) (1 - eps) - log sigmoid(-beta z) eps,
           z = (pi_c - ref_c) - (pi_r - ref_r)              (eps: --label-smoothing, cDPO)
           ipo: (z - 1 / (2 beta))^2
           rewards/chosen = beta (pi_c - ref_c), rewards/rejected = beta (pi_r - ref_r)
    SimPO  loss = -log sigmoid(beta (m_c - m_r) - gamma)    (m: the per-token means pi / n)
           rewards/chosen = beta m_c, rewards/rejected = beta m_r
    ORPO   loss = NLL - lambda mean log sigmoid(log odds),
           log odds = (m_c - m_r) - (log(1 - e^m_c) - log(1 - e^m_r))
           NLL: the chosen rows' cross-entropy averaged over their `real` targets (TRL's:
           the prompt's and the completion's); rewards/chosen = lambda m_c, ... = lambda m_r

and every objective logs TRL's metrics: rewards/chosen, rewards/rejected, rewards/accuracies
(rewards/chosen > rewards/rejected), rewards/margins, logps/chosen, logps/rejected (the sums
for DPO, the means for SimPO and ORPO, as TRL logs what its loss uses), ORPO also nll_loss,
log_odds_ratio, log_odds_chosen. Every metric is a mean over the step's pairs (the loss too,
and ORPO's NLL over the step's chosen tokens), so gradient accumulation of K micro-batches of
B pairs equals one batch of K x B pairs.

DPO's reference: `ref` [2B], the reference model's per-sequence sums: the frozen base with
the adapters off for LoRA / QLoRA (computed in the step, jaxmem.train.step), or precomputed
before training for a full fine-tune (the batch's `ref_logps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmem.objective.base import CausalLM, Objective, sequence_sums, token_logps


def _pairs(x):
    """[2B, ...] -> (chosen [B, ...], rejected [B, ...]): rows 0, 2, 4 ... and 1, 3, 5 ..."""
    return x[0::2], x[1::2]


def _log_sigmoid_loss(x, smoothing: float):
    return -jax.nn.log_sigmoid(x) * (1 - smoothing) - jax.nn.log_sigmoid(-x) * smoothing


class _Preference(Objective):
    """What the three share: the pair counts, the rewards' metrics and their normalisation."""

    preference = "dpo"
    rows_per_example = 2
    unit = "pairs"

    def counts(self, batch) -> dict:
        chosen = batch["mask"][..., 0::2, :]  # [..., B, T]
        return {"pairs": jnp.sum(jnp.any(chosen > 0, axis=-1)).astype(jnp.float32)}

    def _metrics(self, valid, r_c, r_r, l_c, l_r) -> dict:
        return {"rewards/chosen": jnp.sum(valid * r_c), "rewards/rejected": jnp.sum(valid * r_r),
                "rewards/accuracies": jnp.sum(valid * (r_c > r_r)),
                "rewards/margins": jnp.sum(valid * (r_c - r_r)),
                "logps/chosen": jnp.sum(valid * l_c), "logps/rejected": jnp.sum(valid * l_r)}

    def value(self, sums, counts, xp=jnp):
        n = xp.maximum(counts["pairs"], 1.0)
        return sums["loss"] / n, {k: v / n for k, v in sums.items() if k != "loss"}


@dataclass(frozen=True)
class DPO(_Preference):
    """Direct preference optimisation against a reference (see the module docstring)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    name = "dpo"
    reference = True

    def head_sums(self, h, head, layout, batch, chunk, ref=None):
        if ref is None:
            raise ValueError("DPO needs the reference's log-probs (ref)")
        s, n = sequence_sums(token_logps(h, head, layout, batch["targets"], chunk), batch)
        (pi_c, pi_r), (ref_c, ref_r) = _pairs(s), _pairs(jax.lax.stop_gradient(ref))
        valid = (_pairs(n)[0] > 0).astype(jnp.float32)
        z = (pi_c - ref_c) - (pi_r - ref_r)
        if self.loss_type == "ipo":
            losses = (z - 1 / (2 * self.beta)) ** 2
        else:
            losses = _log_sigmoid_loss(self.beta * z, self.label_smoothing)
        r_c, r_r = (jax.lax.stop_gradient(self.beta * d) for d in (pi_c - ref_c, pi_r - ref_r))
        return {"loss": jnp.sum(valid * losses),
                **self._metrics(valid, r_c, r_r, *map(jax.lax.stop_gradient, (pi_c, pi_r)))}

    def flags(self) -> dict:
        return {"objective.objective": "dpo", "objective.beta": self.beta,
                "objective.label_smoothing": self.label_smoothing,
                "objective.loss_type": self.loss_type}


@dataclass(frozen=True)
class SimPO(_Preference):
    """Simple preference optimisation: length-normalised, no reference (TRL's CPOTrainer with
    loss_type="simpo", cpo_alpha=0)."""

    beta: float = 0.1
    gamma: float = 0.5
    label_smoothing: float = 0.0
    name = "simpo"
    preference = "cpo"

    def head_sums(self, h, head, layout, batch, chunk, ref=None):
        s, n = sequence_sums(token_logps(h, head, layout, batch["targets"], chunk), batch)
        m_c, m_r = _pairs(s / jnp.maximum(n, 1.0))
        valid = (_pairs(n)[0] > 0).astype(jnp.float32)
        losses = _log_sigmoid_loss(self.beta * (m_c - m_r) - self.gamma, self.label_smoothing)
        r_c, r_r = (jax.lax.stop_gradient(self.beta * m) for m in (m_c, m_r))
        return {"loss": jnp.sum(valid * losses),
                **self._metrics(valid, r_c, r_r, *map(jax.lax.stop_gradient, (m_c, m_r)))}

    def flags(self) -> dict:
        return {"objective.objective": "simpo", "objective.beta": self.beta,
                "objective.gamma": self.gamma, "objective.label_smoothing": self.label_smoothing}


@dataclass(frozen=True)
class ORPO(_Preference):
    """Odds-ratio preference optimisation: the chosen answers' NLL plus lambda x the odds
    ratio's log-sigmoid, no reference."""

    orpo_lambda: float = 0.1
    name = "orpo"
    preference = "cpo"
    batch_keys = ("inputs", "targets", "mask", "real")

    def counts(self, batch) -> dict:
        real_c = batch["real"][..., 0::2, :]
        return {**super().counts(batch), "nll_tokens": jnp.sum(real_c).astype(jnp.float32)}

    def head_sums(self, h, head, layout, batch, chunk, ref=None):
        logp = token_logps(h, head, layout, batch["targets"], chunk)
        s, n = sequence_sums(logp, batch)
        m_c, m_r = _pairs(s / jnp.maximum(n, 1.0))
        valid = (_pairs(n)[0] > 0).astype(jnp.float32)
        nll = -jnp.sum(_pairs(logp)[0] * _pairs(batch["real"].astype(jnp.float32))[0])
        log_odds = (m_c - m_r) - (jnp.log1p(-jnp.exp(m_c)) - jnp.log1p(-jnp.exp(m_r)))
        ratio = jax.nn.log_sigmoid(log_odds)
        r_c, r_r = (jax.lax.stop_gradient(self.orpo_lambda * m) for m in (m_c, m_r))
        sg = jax.lax.stop_gradient
        return {"ratio": -self.orpo_lambda * jnp.sum(valid * ratio), "nll": nll,
                **self._metrics(valid, r_c, r_r, sg(m_c), sg(m_r)),
                "log_odds_ratio": jnp.sum(valid * sg(ratio)),
                "log_odds_chosen": jnp.sum(valid * sg(log_odds))}

    def value(self, sums, counts, xp=jnp):
        n = xp.maximum(counts["pairs"], 1.0)
        nll = sums["nll"] / xp.maximum(counts["nll_tokens"], 1.0)
        metrics = {k: v / n for k, v in sums.items() if k not in ("ratio", "nll")}
        nll_metric = jax.lax.stop_gradient(nll) if xp is jnp else nll
        return nll + sums["ratio"] / n, {**metrics, "nll_loss": nll_metric}

    def flags(self) -> dict:
        return {"objective.objective": "orpo", "objective.orpo_lambda": self.orpo_lambda}


def objective_of(section) -> Objective:
    """The objective of a RunConfig's objective section (jaxmem.config.objective)."""
    name = section.objective
    if name == "dpo":
        return DPO(section.beta, section.label_smoothing, section.loss_type)
    if name == "simpo":
        return SimPO(section.beta, section.gamma, section.label_smoothing)
    if name == "orpo":
        return ORPO(section.orpo_lambda)
    return CausalLM()
