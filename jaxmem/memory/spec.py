"""StepSpec: one train step as the planner plans it, described once: the StepConfig and loss
scale a run is built from (jaxmem.train.run.make_step_config), the batch shape and where a LoRA
base lives. The analytic model reads it, the compiler builds the step from it, the search varies
it (`replace`) and the `--measure` worker receives it as JSON (`to_json` / `from_json`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field

from jaxmem.families.config import ModelConfig, upgrade_fields
from jaxmem.config.objective import ObjectiveSection
from jaxmem.config.run import OptimConfig, PeftSection, RunConfig
from jaxmem.objective import CausalLM, Objective, objective_of
from jaxmem.model.precision import Precision, get_precision
from jaxmem.model.remat import RematPolicy
from jaxmem.optim import LossScale
from jaxmem.peft.lora import trainable_of
from jaxmem.peft.trainable import FullFineTune, Trainable
from jaxmem.model.attention import attention_path, on_xla
from jaxmem.train import Footprint, Placement, StepConfig, footprint, make_step_config

GiB = 2**30

# the StepConfig's fields and the optimizer config's that the planner varies by name
_STEP = ("model", "precision", "remat", "grad_accum", "trainable", "loss_chunk", "objective")
_OPTIM = ("optimizer", "mu_dtype", "in_backward", "offload_optimizer", "offload_params",
          "update_kernel")


@dataclass(frozen=True)
class StepSpec:
    """One train step: `step` (the StepConfig the run builds), the micro-batch B x `seq_len`,
    `offload_base` ("host": a LoRA run's frozen block layers in pinned host memory) and
    `attention` ("xla" or "cudnn"; None: jaxmem.model.attention.attention_path's pick).
    `spec.model`, `spec.mu_dtype`, ... read the StepConfig's own parts; `replace` makes a new spec
    through make_step_config, validated. `loss_scale`: make_step_config's (not compared).
    """

    step: StepConfig
    batch_size: int
    seq_len: int
    offload_base: str = "none"
    attention: str | None = None
    loss_scale: LossScale | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        # the peft fields checked as a run's are (--offload-base host needs LoRA / QLoRA)
        PeftSection(**{k.partition(".")[2]: v for k, v in self.trainable.flags().items()},
                    offload_base=self.offload_base)

    @classmethod
    def of(cls, model: ModelConfig, precision: Precision, remat: RematPolicy, batch_size: int,
           seq_len: int, grad_accum: int = 1, mu_dtype: str | None = None,
           attention: str | None = None, trainable: Trainable = FullFineTune(),
           loss_chunk: int | None = None, optimizer: str = "adamw", offload_base: str = "none",
           in_backward: bool = False, offload_optimizer: str = "none",
           offload_params: str = "none", objective: Objective = CausalLM(),
           update_kernel: str = "xla") -> "StepSpec":
        """A spec from its parts (the optimizer's config: the defaults but for `optimizer`,
        `mu_dtype`, `in_backward`, which plans with --clip 0, as it needs, and where the state
        lives, `offload_optimizer` and `offload_params`, and adamw8bit's `update_kernel`)."""
        optim = dataclasses.replace(OptimConfig(), optimizer=optimizer, mu_dtype=mu_dtype,
                                    in_backward=in_backward, offload_optimizer=offload_optimizer,
                                    offload_params=offload_params, update_kernel=update_kernel,
                                    **({"clip": 0.0} if in_backward else {}))
        step, loss_scale = make_step_config(model, precision, remat, optim, seq_len,
                                            grad_accum=grad_accum, trainable=trainable,
                                            loss_chunk=loss_chunk, objective=objective)
        return cls(step, batch_size, seq_len, offload_base, attention, loss_scale)

    @classmethod
    def from_run_config(cls, cfg: RunConfig, attention: str | None = None) -> "StepSpec":
        """The step of a run (what `jaxmem.train` would run with `cfg`)."""
        d = cfg.data
        return cls.of(cfg.model_config(), get_precision(cfg.precision.mode),
                      RematPolicy.parse(cfg.remat.policy), d.batch_size, d.seq_len, d.grad_accum,
                      cfg.optim.mu_dtype, attention, trainable_of(cfg.peft), cfg.remat.loss_chunk,
                      cfg.optim.optimizer, cfg.peft.offload_base, cfg.optim.in_backward,
                      cfg.optim.offload_optimizer, cfg.optim.offload_params,
                      objective_of(cfg.objective), cfg.optim.update_kernel)

    def __getattr__(self, name):  # the StepConfig's parts, and its optimizer config's
        if name in _STEP:
            return getattr(self.step, name)
        if name in _OPTIM:
            return getattr(self.step.optim, name)
        raise AttributeError(f"StepSpec has no attribute {name!r}")

    def replace(self, **changes) -> "StepSpec":
        """This spec with `changes` to any of its fields or its step's parts."""
        parts = {k: getattr(self, k) for k in (*_STEP, *_OPTIM, "batch_size", "seq_len",
                                               "offload_base", "attention")}
        unknown = set(changes) - set(parts)
        if unknown:
            raise TypeError(f"StepSpec.replace: unknown field(s) {sorted(unknown)}")
        return StepSpec.of(**{**parts, **changes})

    @property
    def placement(self) -> Placement:
        """Where this step's parts live on one device (the trainer's Placement: it answers
        `base_on_host`, `state_on_host`, `host_parts`; the planner compares no mode name)."""
        return Placement(None, self.offload_base, self.offload_optimizer, self.offload_params)

    @functools.cached_property
    def footprint(self) -> Footprint:
        """What the step holds and moves beyond its arguments, as the trainer states it
        (jaxmem.train.footprint): the planner's one question to the trainer's rules."""
        return footprint(self.step, self.rows, self.seq_len)

    @property
    def rows(self) -> int:
        """Sequences per micro-batch: `batch_size` examples of the objective's rows each (a
        preference pair is two rows, chosen and rejected)."""
        return self.batch_size * self.objective.rows_per_example

    @property
    def attention_on_xla(self) -> bool:
        """Whether the step's attention is XLA's (probabilities recomputed in the backward)."""
        return on_xla(self.attention_path)

    def step_config(self) -> tuple[StepConfig, LossScale]:
        """(StepConfig, initial loss scale: make_step_config's, the precision mode's own)."""
        return self.step, self.loss_scale

    @property
    def attention_path(self) -> str:
        """The path the step's attention takes (jaxmem.model.attention decides)."""
        if self.attention:
            return self.attention
        c, B, T = self.model, self.batch_size, self.seq_len
        # q [B, T, N, H], kv [B, S, K, H]; causal-only: the step passes no padding mask
        return attention_path((B, T, c.num_heads, c.resolved_head_dim),
                              (B, T, c.num_kv_heads, c.resolved_head_dim),
                              self.precision.compute_dtype, causal_only=True).path

    def to_json(self) -> str:
        """The spec as one JSON object of its parts (precision and remat by name)."""
        s = self.step
        return json.dumps({
            "model": dataclasses.asdict(s.model), "precision": s.precision.name,
            "remat": str(s.remat), "optim": dataclasses.asdict(s.optim),
            "grad_accum": s.grad_accum, "loss_chunk": s.loss_chunk,
            "trainable": s.trainable.flags(), "objective": s.objective.flags(),
            "batch_size": self.batch_size,
            "seq_len": self.seq_len, "offload_base": self.offload_base,
            "attention": self.attention}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "StepSpec":
        """Inverse of `to_json` (a spec written before `norm_placement` replaced `sandwich_norms`
        reads as it did: `upgrade_fields`)."""
        d = json.loads(text)
        peft = PeftSection(**{k.partition(".")[2]: v for k, v in d["trainable"].items()})
        step, loss_scale = make_step_config(
            ModelConfig(**upgrade_fields(d["model"])), get_precision(d["precision"]),
            RematPolicy.parse(d["remat"]), OptimConfig(**d["optim"]), d["seq_len"],
            grad_accum=d["grad_accum"], trainable=trainable_of(peft),
            loss_chunk=d["loss_chunk"], objective=objective_of(ObjectiveSection(**{
                k.partition(".")[2]: v for k, v in d.get("objective", {}).items()})))
        return cls(step, d["batch_size"], d["seq_len"], d["offload_base"], d["attention"],
                   loss_scale)

