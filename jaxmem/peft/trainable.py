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

    trains_base: the state's params are the model's own weights (so `--init-from` loads them
        into the state, and per-layer in-backward updates apply); False: adapters over a base.
    """

    trains_base: bool = True

    def init_params(self, model_cfg, key, dtype, given=None) -> Any:
        """The train state's initial params (traceable): `given` (step-0 weights) or the init."""
        raise NotImplementedError

    def model_params(self, params, frozen, dtype, key=None) -> tuple[Any, Any]:
        """(the params tree the model applies, the dtype to cast it to or None when it is cast
        already) from the state's `params` and the `frozen` base; `key`: dropout's (None: off)."""
        raise NotImplementedError

    def abstract_frozen(self, model_cfg, dtype) -> Any:
        """The frozen base's shapes and dtypes (allocating nothing); None: nothing is frozen."""
        raise NotImplementedError

    def prepare_frozen(self, cfg, model_cfg, step_cfg, record, init_from, shardings):
        """(the frozen base on the device or None, its config.json record or None)."""
        raise NotImplementedError

    def check_in_backward(self, flag: str) -> None:
        """Raise ConfigError naming `flag` where the optimizer cannot run inside the backward."""

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

    # What the trainable params take in memory (the planner, jaxmem.memory.analytic)
    params_name: str = "params"  # what the state's params are called in a breakdown
    plain_einsum: bool = True  # every projection is a plain einsum (its MLP may be tiled)

    def trained_params(self, c) -> int:
        """How many values the optimizer updates."""
        raise NotImplementedError

    def saved_per_layer(self, c, B: int, T: int, dtype, remat) -> list:
        """Residuals per block beyond the model's own (jaxmem.memory.residuals' form)."""
        return []

    def backward_transient(self, c, B: int, T: int, dtype) -> int:
        """Bytes one block's backward needs beyond the model's own."""
        return 0

    def frozen_components(self, c, dtype) -> list:
        """(name, bytes, dtype) of the frozen base as the step holds it ([]: nothing frozen)."""
        return []


@dataclass(frozen=True)
class FullFineTune(Trainable):
    """Every weight trains; nothing is frozen."""

    trains_base = True

    def init_params(self, model_cfg, key, dtype, given=None):
        from jaxmem.model.llama import init_params
        return init_params(model_cfg, key, dtype=dtype) if given is None else given

    def model_params(self, params, frozen, dtype, key=None):
        return params, dtype

    def abstract_frozen(self, model_cfg, dtype):
        return None

    def prepare_frozen(self, cfg, model_cfg, step_cfg, record, init_from, shardings):
        return None, None

    def run_params(self, run):
        return run.state.params

    merged_params = run_params

    def export_adapters(self, run, out, args=None):
        raise ValueError(f"run {run.config.run.out}: not a LoRA run (no --lora-rank); export "
                         f"the full weights instead")

    def flags(self) -> dict:
        return {}

    def trained_params(self, c) -> int:
        return c.num_params()
