"""The optimizer section of a RunConfig (jaxmem.config.run): the optimizer, its schedule, clipping,
and where its update happens (--optimizer-in-backward) and its state and the weights live
(--offload-optimizer / --offload-params host)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmem.config.fields import option
from jaxmem.errors import ConfigError

OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "lion")  # jaxmem.train.optim.make_optimizer


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its schedule (jaxmem.train.optim).

    lr: peak learning rate, reached after `warmup_steps`.
    min_lr: floor of the cosine decay, reached at `total_steps`.
    decay_embeddings: also apply weight decay to the embedding (norms never decay).
    mu_dtype: dtype of Adam's first moment (None: the params' dtype).
    clip: max global gradient norm (0 disables clipping).
    moment_rounding: adamw8bit's rounding of its moments ("stochastic" or "nearest").
    update_kernel: adamw8bit's update kernels ("xla" or "pallas": jaxmem.optim._kernel).
    """

    lr: float = option(3e-3, "peak learning rate", type="nonneg_float")
    min_lr: float = option(3e-4, "cosine decay floor", type="nonneg_float")
    warmup_steps: int = option(30, "linear warmup steps", type="nonneg_int")
    total_steps: int = option(300, "optimizer steps in total (the cosine spans them)",
                              flags=("--steps",), type="positive_int")
    b1: float = option(0.9, "Adam beta1", cli=False)
    b2: float = option(0.95, "Adam beta2", cli=False)
    eps: float = option(1e-8, "Adam epsilon", cli=False)
    weight_decay: float = option(0.1, "AdamW decoupled weight decay (not on norms or embeddings)",
                                 type="nonneg_float")
    decay_embeddings: bool = option(False, "also decay the embedding", cli=False)
    clip: float = option(1.0, "clip gradients to this global norm after unscaling (0: off)",
                         type="nonneg_float")
    mu_dtype: str | None = option(None, "dtype of Adam's first moment (default: the params' dtype)",
                                  choices=["fp32", "bf16"])
    optimizer: str = option("adamw", "adamw, adamw8bit (8-bit block-wise moments), adafactor, "
                            "lion (docs/optimizers.md)", choices=list(OPTIMIZERS))
    # Changes no state's layout, only how adamw8bit rounds its moments: a run may resume with
    # the other one.
    moment_rounding: str = option(
        "stochastic", "adamw8bit: how its 8-bit moments are rounded each step: stochastic "
        "(unbiased, ends closer to fp32 AdamW) or nearest (bitsandbytes' rule; "
        "docs/optimizers.md)", choices=["stochastic", "nearest"], mutable=True)
    # Changes no state, only which kernels run adamw8bit's update: a run may resume with either.
    update_kernel: str = option(
        "xla", "adamw8bit with bf16 weights and stochastic rounding (bf16-sr, fp8-sr): xla = "
        "each large leaf's update in row pieces, XLA's kernels; pallas = one Pallas kernel per "
        "leaf that reads and writes each element once (the same update up to bf16 rounding; "
        "on CPU Pallas' slow interpreter, for tests; on a GPU a Triton kernel whose equality "
        "with xla is not yet measured; docs/optimizers.md)",
        choices=["xla", "pallas"], mutable=True)
    # Changes no state, only where the update happens: a run may resume with it (or without).
    in_backward: bool = option(False, "apply each layer's optimizer update inside the backward "
                               "pass, as soon as its gradients exist, so the gradient tree never "
                               "exists whole (one device; --remat full or offload:block_input, "
                               "--clip 0; no --grad-accum, loss scaling, LoRA; docs/optimizers.md)",
                               flags=("--optimizer-in-backward",), store_true=True, mutable=True)
    # Changes no number of the run, only where the state lives: a run may resume with it or not.
    offload_optimizer: str = option("none", "where the optimizer state lives between steps: "
                                    "none = on the accelerator; host = in pinned host memory, "
                                    "streamed to the device for its update (--optimizer "
                                    "adamw8bit; others: --optimizer-in-backward, one device)",
                                    choices=["none", "host"], mutable=True)
    # As offload_optimizer: only where the weights live; a run may resume with it or without.
    offload_params: str = option("none", "where the trained weights' stacked layer leaves live: "
                                 "none = on the accelerator; host = in pinned host memory, a "
                                 "layer copied to the device when used (one device; needs "
                                 "--optimizer-in-backward)", choices=["none", "host"], mutable=True)

    @property
    def state_on_host(self) -> bool:
        """Any part of the train state in pinned host memory (--offload-optimizer or
        --offload-params host): the state is then made program by program (host_state)."""
        return self.offload_optimizer == "host" or self.params_on_host

    @property
    def params_on_host(self) -> bool:
        """--offload-params host: the weights' stacked layer leaves live in pinned host memory
        (the in-backward step streams them whole layers at a time)."""
        return self.offload_params == "host"

    def __post_init__(self):
        checks = [("lr", self.lr >= 0), ("min_lr", 0 <= self.min_lr),
                  ("warmup_steps", self.warmup_steps >= 0), ("total_steps", self.total_steps > 0),
                  ("weight_decay", self.weight_decay >= 0), ("clip", self.clip >= 0),
                  ("b1", 0 <= self.b1 < 1), ("b2", 0 <= self.b2 < 1), ("eps", self.eps > 0)]
        for name, ok in checks:
            value = getattr(self, name)
            if not ok or value != value:  # value != value: NaN
                raise ConfigError(f"optimizer {name}={value!r} is invalid")
        if self.mu_dtype not in (None, "fp32", "bf16", "float32", "bfloat16"):
            raise ConfigError(f"--mu-dtype {self.mu_dtype!r} is invalid; choose fp32 or bf16")
        if self.moment_rounding not in ("stochastic", "nearest"):
            raise ConfigError(f"--moment-rounding {self.moment_rounding!r} is invalid; choose "
                              "stochastic or nearest")
        if self.update_kernel not in ("xla", "pallas"):
            raise ConfigError(f"--update-kernel {self.update_kernel!r} is invalid; choose xla "
                              "or pallas")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer {self.optimizer!r} is invalid; choose one of: "
                              f"{', '.join(OPTIMIZERS)}")
        for flag, value in (("--offload-optimizer", self.offload_optimizer),
                            ("--offload-params", self.offload_params)):
            if value not in ("none", "host"):
                raise ConfigError(f"{flag} {value!r} is not one of none, host")
        if self.params_on_host and not self.in_backward:
            raise ConfigError("--offload-params host needs --optimizer-in-backward: the weights "
                              "are streamed layer by layer by the in-backward update")
        # without in-backward only adamw8bit's update streams a host-resident state (in pieces)
        streams = self.in_backward or self.optimizer == "adamw8bit"
        if self.offload_optimizer == "host" and not streams:
            raise ConfigError(f"--offload-optimizer host with --optimizer {self.optimizer} needs "
                              f"--optimizer-in-backward (only adamw8bit's update streams without)")
