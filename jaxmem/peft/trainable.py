"""What a run trains, as an object: the one place that knows whether the train state's params are
the model's own weights (a full fine-tune) or adapters over a frozen base (LoRA, QLoRA).

    trainable = trainable_of(cfg.peft)         # jaxmem.peft.lora: FullFineTune() or a LoraSpec
    params = trainable.init_params(model_cfg, key, param_dtype)        # the state's params
    frozen = trainable.abstract_frozen(model_cfg, compute_dtype)       # None, or the base
    applied, dtype = trainable.model_params(params, frozen, compute_dtype, key)
    logits = model.apply({"params": cast(applied, dtype)}, tokens)     # dtype None: cast done

The trainer, the planner, generation and export ask these questions of the object and never of
the run's flags. `FullFineTune` (here) trains every weight; `jaxmem.peft.lora.LoraSpec` trains
rank-R adapters over a frozen base that is stored as is (LoRA) or in int8 / NF4 (QLoRA, its
`quantize` field).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Trainable:
    """The interface (see the module docstring); every method is answered by each subclass.
    Callers never ask which subclass they hold: they ask the object."""

    def init_params(self, model_cfg, key, dtype, given=None) -> Any:
        """The train state's initial params (traceable): `given` (step-0 weights) or the init."""
        raise NotImplementedError

    def model_params(self, params, frozen, dtype, key=None) -> tuple[Any, Any]:
        """(the params tree the model applies, the dtype to cast it to or None when it is cast
        already) from the state's `params` and the `frozen` base; `key`: dropout's (None: off)."""
        raise NotImplementedError

    def reference_params(self, params, frozen, dtype) -> tuple[Any, Any]:
        """(the params tree of the reference model, the dtype to cast it to or None) for an
        objective with a reference (DPO): the frozen base with the adapters off for LoRA;
        ValueError where the trainable holds no reference (a full fine-tune precomputes its
        reference's log-probs instead: jaxmem.train.reference)."""
        raise NotImplementedError

    def abstract_frozen(self, model_cfg, dtype) -> Any:
        """The frozen base's shapes and dtypes (allocating nothing); None: nothing is frozen."""
        raise NotImplementedError

    def prepare_frozen(self, cfg, model_cfg, step_cfg, record, init_from, shardings):
        """(the frozen base on the device or None, its config.json record or None)."""
        raise NotImplementedError

    def step_args(self, frozen) -> tuple:
        """The step's and evaluation's arguments after (state, batch): `(frozen,)` where a base
        is frozen, () for a full fine-tune. `frozen`: the base, its abstract form, its shardings."""
        raise NotImplementedError

    def params_from_checkpoint(self, read) -> Any:
        """The state's step-0 params for `--init-from`: `read()` (the checkpoint's weights) for a
        full fine-tune; None for adapters (they start at init; the checkpoint is their base)."""
        raise NotImplementedError

    def check_in_backward(self, flag: str) -> None:
        """Raise ConfigError naming `flag` where the optimizer cannot run inside the backward."""

    def check_model(self, model_cfg) -> None:
        """Raise ConfigError (one line, naming the flags) where this cannot train `model_cfg`
        (a ModelConfig), before anything is built from it."""

    def describe(self, params) -> str:
        """What trains, for the run's first line ("" for a full fine-tune)."""
        return ""

    def run_params(self, run) -> Any:
        """The params a saved run's model computes with (jaxmem.train.rundir.load_run's run)."""
        raise NotImplementedError

    def merged_params(self, run) -> Any:
        """A saved run's dense weights, as exported to Hugging Face."""
        raise NotImplementedError

    def export_adapters(self, run, out, args=None) -> list:
        """Write the run's adapters in PEFT's layout (ValueError for a run without adapters)."""
        raise NotImplementedError

    def flags(self) -> dict:
        """This choice as RunConfig fields ({"peft.lora_rank": ..., ...}; {} for the default)."""
        raise NotImplementedError

    # The planner (jaxmem.memory) counts the state, the base and the batch on their abstract
    # values; it asks a trainable only what no argument holds: the two below.
    params_name: str = "params"  # what the state's params are called in a breakdown

    def mlp_tile(self, tile: int) -> int:
        """The MLP's sequence tile: `tile` where every projection is a plain einsum, else 0."""
        raise NotImplementedError

    def activations(self, c, B: int, T: int, dtype, remat) -> tuple[list, int]:
        """What this trainable adds to one block's activations beyond the model's own:
        (residuals it saves, as (name, bytes, dtype); bytes its backward adds transiently)."""
        return [], 0

@dataclass(frozen=True)
class FullFineTune(Trainable):
    """Every weight trains; nothing is frozen."""

    def init_params(self, model_cfg, key, dtype, given=None):
        from jaxmem.families.params import init_params
        return init_params(model_cfg, key, dtype=dtype) if given is None else given

    def model_params(self, params, frozen, dtype, key=None):
        return params, dtype

    def reference_params(self, params, frozen, dtype):
        raise ValueError("a full fine-tune keeps no reference model: its reference log-probs "
                         "are precomputed (--reference precompute, the batch's ref_logps)")

    def abstract_frozen(self, model_cfg, dtype):
        return None

    def prepare_frozen(self, cfg, model_cfg, step_cfg, record, init_from, shardings):
        return None, None

    def step_args(self, frozen):
        return ()

    def params_from_checkpoint(self, read):
        return read()

    def run_params(self, run):
        return run.state.params

    merged_params = run_params

    def export_adapters(self, run, out, args=None):
        raise ValueError(f"run {run.config.run.out}: not a LoRA run (no --lora-rank); export "
                         f"the full weights instead")

    def flags(self) -> dict:
        return {}

    def mlp_tile(self, tile):
        return tile
