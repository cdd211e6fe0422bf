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
    Callers never ask which subclass they hold: where jaxmem.train or jaxmem.memory would
    branch on it, a method here takes both outcomes (values or callables) and picks one."""

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

    # What the trainable params take in memory (the planner, jaxmem.memory): jaxmem.peft does not
    # import jaxmem.memory, so the methods below take what memory computes and pick from it.
    params_name: str = "params"  # what the state's params are called in a breakdown

    def mlp_tile(self, tile: int) -> int:
        """The MLP's sequence tile: `tile` where every projection is a plain einsum, else 0."""
        raise NotImplementedError

    def compute_copy(self, castable: int, trained: int) -> int:
        """Params the backward holds cast to the compute dtype: the model's `castable` ones, or
        the adapters (`trained`: a frozen base is stored in the compute dtype already)."""
        raise NotImplementedError

    def optimizer_state(self, adam: list, counted) -> list:
        """(name, bytes, dtype) of a non-AdamW optimizer's state: `counted()` on the model's
        abstract state, or for adapters `adam` (AdamW-sized: an upper bound)."""
        raise NotImplementedError

    def adamw8bit_update(self, in_place, buffer):
        """adamw8bit's update working set: `in_place()` (the model's weights, updated piece by
        piece in place), or `buffer` (the adapters go through the optax update)."""
        raise NotImplementedError

    def state_fraction(self, params, adapters) -> float:
        """The fraction of the trainable params one device holds: `params()` or `adapters()`."""
        raise NotImplementedError

    def per_device_weights(self, base, gathered) -> list:
        """Weights per device beyond the state: `base()` (the frozen base split leaf by leaf),
        or `gathered()` (what a full fine-tune gathers of one layer under fsdp)."""
        raise NotImplementedError

    def fit_devices(self, mesh_only, mesh_and_step):
        """`--fit --devices` without --global-batch: `mesh_only()` (a full fine-tune searches
        meshes at its micro-batch) or `mesh_and_step()` (LoRA: meshes and micro-batches)."""
        raise NotImplementedError

    def import_phase(self, analytic_import) -> dict:
        """{} for a full fine-tune; {"import": analytic_import()}: a frozen base is imported
        before the state is made (jaxmem.memory.phases)."""
        raise NotImplementedError

    def sample_cast(self, params, adapters) -> int:
        """Bytes of the sampler's cast weights: `params()` (the model's) or `adapters()` (the
        adapters cast, the base as stored)."""
        raise NotImplementedError

    def trained_params(self, c) -> int:
        """How many values the optimizer updates."""
        raise NotImplementedError

    def saved_per_layer(self, c, B: int, T: int, dtype, remat) -> list:
        """Residuals per block beyond the model's own (jaxmem.xla.residuals' form)."""
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

    def init_params(self, model_cfg, key, dtype, given=None):
        from jaxmem.model.llama import init_params
        return init_params(model_cfg, key, dtype=dtype) if given is None else given

    def model_params(self, params, frozen, dtype, key=None):
        return params, dtype

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

    def trained_params(self, c) -> int:
        return c.num_params()

    def mlp_tile(self, tile):
        return tile

    def compute_copy(self, castable, trained):
        return castable

    def optimizer_state(self, adam, counted):
        return counted()

    def adamw8bit_update(self, in_place, buffer):
        return in_place()

    def state_fraction(self, params, adapters):
        return params()

    def per_device_weights(self, base, gathered):
        return gathered()

    def fit_devices(self, mesh_only, mesh_and_step):
        return mesh_only()

    def import_phase(self, analytic_import):
        return {}

    def sample_cast(self, params, adapters):
        return params()
