"""StepSpec: one train-step configuration, everything the memory of a step depends on.

It is its own module because every other piece needs it and none of them needs the others: the
analytic model reads its shapes, the compiler builds the step from it, the planner varies it,
and the `--measure` worker receives it as JSON (`to_json` / `from_json`) so that the child
process measures exactly the configuration the parent chose, never a re-parsed command line.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from jaxmem.config.model import ModelConfig
from jaxmem.config.run import ModelSection, OptimConfig, PeftSection, RunConfig
from jaxmem.model.remat import RematPolicy
from jaxmem.optim import LossScale
from jaxmem.model.precision import Precision, get_precision
from jaxmem.peft.lora import trainable_of
from jaxmem.peft.trainable import FullFineTune, Trainable
from jaxmem.train.run import make_step_config
from jaxmem.train.step import StepConfig

GiB = 2**30


@dataclass(frozen=True)
class StepSpec:
    """One train-step configuration: everything the memory of a step depends on.

    batch_size: micro-batch B (sequences per forward/backward).
    grad_accum: micro-batches K per optimizer step (global batch = K * B).
    mu_dtype: Adam first-moment dtype, "fp32" or "bf16" (None: the params' dtype).
    attention: "xla" (softmax probabilities [B, N, T, S] are materialized in the forward and
        recomputed in the backward, never saved:
        jaxmem.model.attention.xla_attention_recomputed) or "cudnn" (flash attention: only the
        output and the softmax statistics are saved);
        None: the path jaxmem.model.attention.attention_path picks for this step's shapes.
    optimizer: `--optimizer` (adamw, adamw8bit, adafactor, lion).
    offload_base: `--offload-base`: "host" keeps a LoRA run's frozen block layers in pinned host
        memory, each layer moved to the device inside the layer scan (jaxmem.memory.counted).
    """

    model: ModelConfig
    precision: Precision
    remat: RematPolicy
    batch_size: int
    seq_len: int
    grad_accum: int = 1
    mu_dtype: str | None = None
    attention: str | None = None
    trainable: Trainable = FullFineTune()  # what trains (jaxmem.peft.trainable): all, LoRA, QLoRA
    loss_chunk: int | None = None  # the fused loss's chunk (None: auto; jaxmem.loss.chunked)
    optimizer: str = "adamw"
    offload_base: str = "none"  # LoRA: where the frozen base lives, "none" or "host" (pinned)
    # --optimizer-in-backward (jaxmem.train.inbackward): each layer updated inside the
    # backward pass; the step is planned with --clip 0, which it needs
    in_backward: bool = False

    def __post_init__(self):
        # the peft fields checked as a run's are (--offload-base host needs LoRA / QLoRA)
        PeftSection(**{k.partition(".")[2]: v for k, v in self.trainable.flags().items()},
                    offload_base=self.offload_base)

    @classmethod
    def from_run_config(cls, cfg: RunConfig, attention: str | None = None) -> "StepSpec":
        """The step of a run (what `jaxmem.train` would run with `cfg`)."""
        d = cfg.data
        return cls(cfg.model_config(), get_precision(cfg.precision.mode),
                   RematPolicy.parse(cfg.remat.policy), d.batch_size, d.seq_len, d.grad_accum,
                   cfg.optim.mu_dtype, attention, trainable_of(cfg.peft), cfg.remat.loss_chunk,
                   cfg.optim.optimizer, cfg.peft.offload_base, cfg.optim.in_backward)

    def run_config(self) -> RunConfig:
        """A RunConfig with this step (its JSON form for the `--measure` worker, and the
        `jaxmem.train` command of a plan)."""
        return RunConfig(model=ModelSection.of(self.model)).replace({
            "precision.mode": self.precision.name, "remat.policy": str(self.remat),
            "data.batch_size": self.batch_size, "data.seq_len": self.seq_len,
            "data.grad_accum": self.grad_accum, "optim.mu_dtype": self.mu_dtype,
            "remat.loss_chunk": self.loss_chunk, "optim.optimizer": self.optimizer,
            **({"optim.in_backward": True, "optim.clip": 0.0} if self.in_backward else {}),
            **self.trainable.flags(), "peft.offload_base": self.offload_base})

    def step_config(self) -> tuple[StepConfig, LossScale]:
        """(StepConfig, initial loss scale), made by the function a training run's are made by
        (jaxmem.train.run.make_step_config), from this spec's own fields."""
        optim = dataclasses.replace(OptimConfig(), optimizer=self.optimizer,
                                    mu_dtype=self.mu_dtype, in_backward=self.in_backward,
                                    **({"clip": 0.0} if self.in_backward else {}))
        return make_step_config(self.model, self.precision, self.remat, optim, self.seq_len,
                                grad_accum=self.grad_accum, trainable=self.trainable,
                                loss_chunk=self.loss_chunk)

    @property
    def attention_path(self) -> str:
        """The path the step's attention takes: jaxmem.model.attention decides (cuDNN accepts it)."""
        if self.attention:
            return self.attention
        from jaxmem.model.attention import attention_path
        c = self.model
        q = (self.batch_size, self.seq_len, c.num_heads, c.resolved_head_dim)  # [B, T, N, H]
        kv = (self.batch_size, self.seq_len, c.num_kv_heads, c.resolved_head_dim)  # [B, S, K, H]
        # causal-only: the step passes no padding mask (StepConfig.attention_padding=False)
        return attention_path(q, kv, self.precision.compute_dtype, causal_only=True).path

    def to_json(self) -> str:
        """The spec as one JSON object: its RunConfig (`run_config`, config.json's own form) and
        the attention override."""
        return json.dumps({"run": self.run_config().to_dict(), "attention": self.attention},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "StepSpec":
        """Inverse of `to_json`; unknown fields raise ConfigError naming them."""
        d = json.loads(text)
        return cls.from_run_config(RunConfig.from_dict(d["run"]), d["attention"])
