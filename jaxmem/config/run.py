"""The run configuration: one frozen, nested `RunConfig`, the single source of truth for a run.

    RunConfig
      model      ModelSection      preset + shape overrides  -> ModelConfig (jaxmem.families.config)
      precision  PrecisionSection  precision mode, loss scaling, the skip limit
      remat      RematSection      remat policy of each decoder block
      optim      OptimConfig       optimizer, warmup + cosine schedule, clipping, mu dtype
      data       DataSection       data, tokenizer, batch shape, seed
      run        RunSection        run directory, saving, evaluation, logging
      sample     SampleSection     the text sampled at the end of a run / by jaxmem.generate
      init       InitSection       step-0 weights: random, or a Hugging Face checkpoint
      parallel   ParallelSection   the device mesh (jaxmem.parallel, docs/distributed.md)
      objective  ObjectiveSection  what the step minimises: causal LM or DPO / ORPO / SimPO

Every field carries its CLI metadata (flag, help, type, whether a resume may change it), so the
flags of `jaxmem.train`, `jaxmem.memory`, `jaxmem.generate` and `experiments.compare` are
generated from here (jaxmem.config.flags), `config.json` is written from `to_dict` and read back
with `from_dict`, and the train step's `StepConfig` is built from a RunConfig alone
(jaxmem.train.run.build_step_config). New sections (the device mesh, fine-tuning) are added as
another frozen dataclass field of RunConfig with its own metadata; nothing else needs to change.

config.json schema versions: 1 (before RunConfig: one flat dict of the train CLI's flags plus a
resolved "model" dict) is read and converted; 2 is this layout; anything newer is refused with a
message naming the version.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxmem.config.objective import ObjectiveSection  # noqa: F401  (a RunConfig section)
from jaxmem.config.data import DataSection  # re-exported: the section lives in its own module
from jaxmem.config.fields import _positive, option
from jaxmem.config.lora import parse_targets
from jaxmem.errors import ConfigError
from jaxmem import families
from jaxmem.families import PRESETS, get_preset
from jaxmem.families.config import ModelConfig, upgrade_fields
from jaxmem.config.optim import OptimConfig  # the optim section lives in its own module
from jaxmem.config.sample import SampleSection  # noqa: F401  (re-exported: a RunConfig section)

SCHEMA_VERSION = 2


# ----------------------------------------------------------------------------- sections

# The ModelConfig fields a flag may override (the shape); every other field comes from the
# preset, or from a checkpoint's config.json by --init-from, and is recorded all the same.
_MODEL_FLAGS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps")
_MODEL_HELP = {"vocab_size": "override the preset's vocab_size (with --tokenizer: the "
                             "tokenizer's by default)"}


def _model_override(f: dataclasses.Field):
    """The section's field for ModelConfig field `f`: None (the preset's value) or an override."""
    cli = f.name in _MODEL_FLAGS
    kind = next((t for t in (int, float) if str(f.type).startswith(t.__name__)), None)
    return (f.name, f"{f.type} | None",
            option(None, _MODEL_HELP.get(f.name, f"override the preset's {f.name}"), cli=cli,
                   type=kind if cli else None))


def _section_config(self) -> ModelConfig:
    """The preset with the overrides applied (validated by ModelConfig)."""
    overrides = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name != "preset"}
    return get_preset(self.preset, **overrides)


def _section_of(cls, model: ModelConfig, preset: str = "tiny"):
    """The section whose `config()` is `model`: the preset plus the fields that differ."""
    base = get_preset(preset)
    return cls(preset, **{f.name: getattr(model, f.name) for f in dataclasses.fields(cls)
                          if f.name != "preset" and getattr(model, f.name) != getattr(base, f.name)})


# Model shape: a named preset, with any of its fields overridden. Its fields are ModelConfig's
# own, one for one (a field added to ModelConfig is recorded in config.json and restored by
# --init-from with no list to update here).
ModelSection = dataclasses.make_dataclass(
    "ModelSection",
    [("preset", "str", option("tiny", f"model shape preset: {', '.join(PRESETS)}",
                              choices=list(PRESETS), metavar="NAME"))]
    # the flagged fields first, in _MODEL_FLAGS' order (--help's and fit_command's), then the rest
    + [_model_override(f) for f in sorted(dataclasses.fields(ModelConfig), key=lambda f: (
        _MODEL_FLAGS.index(f.name) if f.name in _MODEL_FLAGS else len(_MODEL_FLAGS)))],
    frozen=True,
    namespace={"config": _section_config, "of": classmethod(_section_of),
               "__doc__": "Model shape: a named preset, with any of its fields overridden."})
ModelSection.__module__ = __name__  # (make_dataclass's `module=` is Python 3.12's)


@dataclass(frozen=True)
class PrecisionSection:
    """Precision mode and loss scaling (docs/precision.md)."""

    mode: str = option("fp32", "precision mode: fp32, bf16, amp-bf16, amp-fp16, fp8, bf16-sr, "
                       "fp8-sr (docs/precision.md)", flags=("--precision",), metavar="MODE",
                       choices=["fp32", "bf16", "amp-bf16", "amp-fp16", "fp8", "bf16-sr",
                                "fp8-sr"])
    loss_scale: str | None = option(None, "dynamic | static:VALUE | none (default: dynamic for "
                                    "amp-fp16, else none)")
    loss_scale_init: float = option(2.0**16, "initial dynamic loss scale (torch GradScaler's default)",
                                    type="positive_float")
    loss_scale_growth_interval: int = option(2000, "finite steps before the dynamic scale doubles",
                                             type="positive_int")
    max_consecutive_skips: int = option(100, "stop with an error after this many non-finite steps "
                                        "in a row", type="positive_int", mutable=True)

    @property
    def fp8_gemms(self) -> bool:
        """The mode's GEMMs are fp8: XLA's flags for them are set before the backend starts
        (jaxmem.model.fp8_compile.set_xla_flags)."""
        return self.mode in ("fp8", "fp8-sr")


@dataclass(frozen=True)
class RematSection:
    """Activation rematerialization (docs/remat.md)."""

    policy: str = option("none", "remat policy for each decoder block: none, full, dots, "
                         "dots_no_batch, offload, names:<tag>[,<tag>...], offload:<tag>[,<tag>...]; "
                         "'+untiled' after full (full+untiled) keeps the MLP whole instead of in "
                         "sequence tiles: more memory, faster",
                         flags=("--remat",))
    loss_chunk: int | None = option(None, "fuse the LM head into the loss in chunks of N "
                                    "positions, never holding [B, T, V] logits (0: off; default: "
                                    "on when vocab > hidden size, chunks of <= 256 MiB of fp32 "
                                    "logits)", type="nonneg_int", metavar="N")

    def __post_init__(self):
        _positive("--loss-chunk", self.loss_chunk, allow_none=True, allow_zero=True)


@dataclass(frozen=True)
class RunSection:
    """The run directory and what happens in it. Everything but `out` may change on resume."""

    out: str | None = option(None, "run directory (default: a new runs/<date>-<time>). If it holds a "
                             "run with the same config, the run continues from its newest "
                             "checkpoint, or from step 0 when none was committed")
    stop_at: int | None = option(None, "stop after STEP steps as if interrupted (save; continue "
                                 "later), e.g. to fit a job's time limit; the schedule still spans "
                                 "--steps", type="positive_int", metavar="STEP", mutable=True)
    save_every: int = option(100, "save every N steps (0: only at the end)", type="nonneg_int",
                             mutable=True)
    keep: int = option(3, "checkpoints to keep", type="positive_int", mutable=True)
    eval_every: int = option(100, "evaluate every N steps (0: only at the end)", type="nonneg_int",
                             mutable=True)
    eval_batches: int = option(8, "batches per evaluation", type="positive_int", mutable=True)
    log_every: int = option(10, "write metrics (and a plain log line without the progress bar) "
                            "every N steps", type="positive_int", mutable=True)
    no_progress: bool = option(False, "no progress bar: a plain line every --log-every steps (also "
                               "when stdout is not a terminal)", store_true=True, mutable=True)
    no_tensorboard: bool = option(False, "do not write TensorBoard events to <out>/tensorboard "
                                  "(written when tensorboardX is installed)", store_true=True,
                                  mutable=True)
    no_memory_check: bool = option(False, "skip the check before the first step that the train "
                                   "step's compiled peak fits the device's memory (made where "
                                   "the backend reports the device's size, as GPUs do; a run "
                                   "that does not fit exits 2 with the planner command); for "
                                   "this invocation only: --resume does not inherit it",
                                   store_true=True, mutable=True)
    profile: str | None = option(None, "write a jax.profiler trace of the run's last 3 steps "
                                 "(after compilation) to DIR: perfetto_trace.json.gz, read by "
                                 "ui.perfetto.dev, TensorBoard's profile plugin or "
                                 "experiments.gpu_check; for this invocation only: --resume does "
                                 "not inherit it", metavar="DIR", mutable=True)
    wandb_project: str | None = option(None, "log to this Weights & Biases project (needs wandb; "
                                       "WANDB_MODE=offline keeps it local)", metavar="PROJECT",
                                       mutable=True)


@dataclass(frozen=True)
class InitSection:
    """Where a run's step-0 weights come from (jaxmem.io.hf): random init, or a checkpoint."""

    init_from: str | None = option(
        None, "start from a Hugging Face checkpoint directory (config.json, safetensors, "
        f"tokenizer.json) of a model jaxmem reads ({families.architectures()}): its family, "
        "shapes, weights and tokenizer replace --preset and --tokenizer "
        "(full fine-tune, in any --precision)", metavar="HF_DIR")


@dataclass(frozen=True)
class PeftSection:
    """LoRA adapters on a frozen, optionally int8 / NF4 quantized base (jaxmem.peft,
    docs/finetune.md). --lora-rank 0 is a full fine-tune; nothing here but --offload-base may
    change on resume."""

    lora_rank: int = option(0, "train rank-R LoRA adapters only, on a frozen base (0: full "
                            "fine-tune)", type="nonneg_int", metavar="R")
    lora_alpha: float = option(16.0, "LoRA scale numerator: the update is alpha/R * A B",
                               type="positive_float", metavar="A")
    lora_targets: str = option("q,k,v,o,gate,up,down", "projections that get adapters "
                               "(comma-separated subset of q,k,v,o,gate,up,down)",
                               metavar="LIST")
    lora_dropout: float = option(0.0, "dropout on the adapters' input", type="nonneg_float",
                                 metavar="P")
    quantize_base: str = option("none", "store the frozen base's block projections in int8 or "
                                "NF4 (QLoRA); needs --lora-rank", choices=["none", "int8", "nf4"])
    quant_block: int = option(64, "values per absmax scale (0: one per output channel, int8 only)",
                              type="nonneg_int", metavar="N")
    double_quant: bool = option(False, "quantize the absmax scales to 8 bits in blocks of 256 "
                                "(NF4: 4.127 instead of 4.5 bits per parameter)", store_true=True)
    # Where the frozen base lives changes no number of the run, only its memory: a run that
    # ran out of device memory may resume with the base moved to the host.
    offload_base: str = option("none", "where the frozen base lives: none = on the accelerator; "
                               "host = in pinned host memory, each layer moved to the device one "
                               "at a time inside the layer scan (needs --lora-rank)",
                               choices=["none", "host"], mutable=True)

    def __post_init__(self):
        _positive("--lora-rank", self.lora_rank, allow_zero=True)
        parse_targets(self.lora_targets)
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.quantize_base not in ("none", "int8", "nf4"):
            raise ConfigError(f"--quantize-base {self.quantize_base!r} is not one of none, int8, nf4")
        if self.quantize_base != "none" and not self.lora_rank:
            raise ConfigError(f"--quantize-base {self.quantize_base} needs --lora-rank: a quantized "
                              f"base is frozen, only LoRA adapters can be trained on it")
        if self.quantize_base == "nf4" and self.quant_block == 0:
            raise ConfigError("--quant-block 0 (per output channel) is for int8 only; NF4 needs "
                              "blocks (64)")
        if self.offload_base not in ("none", "host"):
            raise ConfigError(f"--offload-base {self.offload_base!r} is not one of none, host")
        if self.offload_base == "host" and not self.lora_rank:
            raise ConfigError("--offload-base host needs --lora-rank: only a frozen base (LoRA / "
                              "QLoRA) can live in host memory, a fully trained one is updated "
                              "every step")


@dataclass(frozen=True)
class ParallelSection:
    """The device mesh (jaxmem.parallel). Mutable: a run saved on one mesh resumes on another
    (the checkpoint is restored onto the current mesh). Which processes take part is not part
    of the run: those flags (--coordinator ...) belong to each launch (jaxmem.parallel.distributed)."""

    mesh: str | None = option(None, "device mesh AXIS=SIZE,... over data, fsdp, tensor, context "
                              "(context: the sequence split over devices; product = "
                              "device count; -1 on one axis takes the rest; default: all devices "
                              "on fsdp; one device: no mesh)", metavar="AXES", mutable=True)


# ----------------------------------------------------------------------------- the whole run

@dataclass(frozen=True)
class RunConfig:
    """Everything a run is made of (see the module docstring); frozen, hashable, JSON-able."""

    model: ModelSection = ModelSection()
    precision: PrecisionSection = PrecisionSection()
    remat: RematSection = RematSection()
    optim: OptimConfig = OptimConfig()
    data: DataSection = DataSection()
    run: RunSection = RunSection()
    sample: SampleSection = SampleSection()
    init: InitSection = InitSection()
    peft: PeftSection = PeftSection()
    parallel: ParallelSection = ParallelSection()
    objective: ObjectiveSection = ObjectiveSection()

    @staticmethod
    def sections() -> dict[str, type]:
        return {f.name: type(f.default) for f in dataclasses.fields(RunConfig)}

    def get(self, path: str):
        """The value at 'section.field'."""
        section, name = path.split(".")
        return getattr(getattr(self, section), name)

    def replace(self, overrides: dict[str, Any]) -> "RunConfig":
        """A copy with {'section.field': value, ...} applied; unknown paths raise ConfigError."""
        by_section: dict[str, dict] = {}
        for path, value in overrides.items():
            section, _, name = path.partition(".")
            if section not in self.sections() or name not in _field_names(section):
                raise ConfigError(f"unknown run config field {path!r}")
            by_section.setdefault(section, {})[name] = value
        try:
            return dataclasses.replace(self, **{
                s: dataclasses.replace(getattr(self, s), **kv) for s, kv in by_section.items()})
        except TypeError as e:
            raise ConfigError(f"invalid run config: {e}") from None

    def model_config(self) -> ModelConfig:
        return self.model.config()

    def to_dict(self) -> dict:
        """{"schema_version": 2, section: {field: value}} (JSON-able)."""
        return {"schema_version": SCHEMA_VERSION,
                **{s: dataclasses.asdict(getattr(self, s)) for s in self.sections()}}

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        """Read `to_dict`'s output, or convert a schema-1 flat dict; refuse newer schemas."""
        version = d.get("schema_version", 1)
        if version == 1:
            return cls().replace(_from_schema_1(d))
        if version != SCHEMA_VERSION:
            raise ConfigError(f"config.json schema_version {version!r} is not supported (this "
                              f"jaxmem reads versions 1 and {SCHEMA_VERSION})")
        unknown = sorted(set(d) - set(cls.sections()) - {"schema_version"})
        if unknown:
            raise ConfigError(f"config.json has unknown section(s): {', '.join(unknown)}")
        flat = {f"{s}.{k}": v for s in cls.sections() for k, v in (
            upgrade_fields(d.get(s) or {}) if s == "model" else d.get(s) or {}).items()}
        return cls().replace(flat)

    def differences(self, other: "RunConfig") -> list[tuple[str, Any, Any]]:
        """(path, self's value, other's value) for every field that differs."""
        return [(p, self.get(p), other.get(p)) for p in all_paths() if self.get(p) != other.get(p)]


def _field_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig.sections()[section])]


def all_paths() -> list[str]:
    """Every 'section.field' of RunConfig, in declaration order."""
    return [f"{s}.{n}" for s in RunConfig.sections() for n in _field_names(s)]


def field_metadata(path: str) -> dict:
    section, name = path.split(".")
    (f,) = [f for f in dataclasses.fields(RunConfig.sections()[section]) if f.name == name]
    return dict(f.metadata)


def flag_names(path: str) -> tuple[str, ...]:
    """The option strings of a field: its `flags`, or `--field-name`."""
    return field_metadata(path).get("flags") or ("--" + path.split(".")[1].replace("_", "-"),)


def is_mutable(path: str) -> bool:
    """May a resumed run change this field? (out is the directory itself: never compared.)"""
    return field_metadata(path)["mutable"] or path == "run.out"


def _from_schema_1(d: dict) -> dict[str, Any]:
    """A schema-1 config.json (the train CLI's flags, flat) as {'section.field': value}."""
    by_flag = {flag[2:].replace("-", "_"): p for p in all_paths() for flag in flag_names(p)}
    return {by_flag[k]: v for k, v in d.items() if k in by_flag}
