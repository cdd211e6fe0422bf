"""The objective section of a RunConfig (jaxmem.config.run): what the step minimises
(jaxmem.objective): next-token cross-entropy, or a preference objective (DPO, ORPO, SimPO) on
chosen / rejected pairs (jaxmem.data.preference, docs/finetune.md "Preference tuning"). None of
these may change on resume."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmem.config.fields import option
from jaxmem.errors import ConfigError

OBJECTIVES = ("causal-lm", "dpo", "orpo", "simpo")
LOSS_TYPES = ("sigmoid", "ipo")
REFERENCES = ("auto", "adapters", "precompute")


@dataclass(frozen=True)
class ObjectiveSection:
    """The objective and its parameters (TRL's names and defaults)."""

    objective: str = option("causal-lm", "what the step minimises: causal-lm (next-token "
                            "cross-entropy on text, chat or prompt/completion rows), or a "
                            "preference objective on {prompt, chosen, rejected} rows: dpo, orpo, "
                            "simpo (--batch-size counts pairs)", choices=list(OBJECTIVES))
    beta: float = option(0.1, "dpo / simpo: the temperature beta of the preference margin",
                         type="positive_float", metavar="B")
    gamma: float = option(0.5, "simpo: the target reward margin gamma (TRL's simpo_gamma)",
                          type="nonneg_float", metavar="G")
    orpo_lambda: float = option(0.1, "orpo: the weight lambda of the odds-ratio term (TRL's "
                                "beta)", type="nonneg_float", metavar="L")
    label_smoothing: float = option(0.0, "dpo / simpo: the probability eps that a label is "
                                    "flipped (conservative DPO); 0 is the plain loss",
                                    type="nonneg_float", metavar="EPS")
    loss_type: str = option("sigmoid", "dpo: sigmoid (the DPO loss) or ipo", choices=list(LOSS_TYPES))
    reference: str = option("auto", "dpo: where the reference's log-probs come from: adapters = "
                            "the frozen base with the LoRA adapters off (LoRA / QLoRA: no second "
                            "copy of any weight); precompute = one pass of the step-0 model over "
                            "the data before training (a full fine-tune); auto picks by "
                            "--lora-rank", choices=list(REFERENCES))
    max_prompt_length: int | None = option(None, "preference rows: keep a prompt's last N "
                                           "tokens (earlier TRL's rule; TRL 1.16 has none), "
                                           "before --seq-len cuts the sequence's end (default: "
                                           "no prompt limit)",
                                           type="positive_int", metavar="N")

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective {self.objective!r} is not one of "
                              f"{', '.join(OBJECTIVES)}")
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"--loss-type {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if self.reference not in REFERENCES:
            raise ConfigError(f"--reference {self.reference!r} is not one of "
                              f"{', '.join(REFERENCES)}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing!r}")
        if self.beta <= 0:
            raise ConfigError(f"--beta must be > 0, got {self.beta!r}")

    def resolved_reference(self, lora: bool) -> str | None:
        """Where DPO's reference comes from for this run (None: the objective needs none)."""
        if self.objective != "dpo":
            return None
        if self.reference == "auto":
            return "adapters" if lora else "precompute"
        if self.reference == "adapters" and not lora:
            raise ConfigError("--reference adapters needs --lora-rank (the reference is the base "
                              "with the adapters off); a full fine-tune uses --reference "
                              "precompute")
        if self.reference == "precompute" and lora:
            raise ConfigError("--reference precompute is for a full fine-tune; a LoRA run's "
                              "reference is its frozen base with the adapters off (--reference "
                              "adapters, the default), which holds no second copy either")
        return self.reference
