"""`python -m jaxmem.eval`: the loss of a run's checkpoint, or of a Hugging Face checkpoint, on
data, computed as the trainer evaluates.

    python -m jaxmem.eval --run runs/small --data held_out.txt
    python -m jaxmem.eval --run runs/qlora --data chats.jsonl --json eval.json
    python -m jaxmem.eval --hf Llama-3.2-1B --data 'wiki/*.txt' --precision bf16 --seq-len 2048
    python -m jaxmem.eval --hf Llama-3.2-1B --data wiki.txt --quantize-base nf4 --double-quant

Every batch of --data is evaluated (not the trainer's 5% split): the windows of the text / token
stream in order, or the example rows (.jsonl / .json / .parquet: text, chat messages, prompt +
completion) packed with their loss masks, as jaxmem.train builds them. The batches, the eval
function and the sum are the trainer's (jaxmem.train.evaluate), so for the same weights and data
the loss equals the `eval_loss` a run logs (a run with `--eval-data` X, evaluated here on X with
the run's batch shape). A LoRA / QLoRA run is evaluated with its adapters on its own base,
quantized as in training. `--hf` evaluates a checkpoint's weights in the --precision's storage
dtype; with --quantize-base its block projections in int8 / NF4 as a QLoRA run stores its base
(through rank-1 adapters whose B is zero: the quantized base alone, exactly).

Output: one line on stdout, `eval: <source> on <data>: loss L, perplexity P[, bits per byte
B]; N target tokens in K batches of B x T (<precision>[, mesh AXES]), S s`. Bits per byte for
jaxmem's byte tokenizer only (jaxmem.train.trackers.eval_metrics). `--json FILE` writes
{"loss", "perplexity", "bits_per_byte" (byte tokenizer only), "tokens" (targets counted: mask
1), "batches", "batch_size", "seq_len", "source" ("run" or "hf"), "path", "step" (--run; null
for --hf), "data", "precision", "quantize_base", "mesh" ({axis: size} of the mesh's axes larger
than 1; null on one device), "seconds"}. With --mesh, a --run's checkpoint is restored on one
device, then split over the mesh.

Bad input (no --run or --hf, both, a missing directory or file, no --data, a flag the source
does not take) exits 2 with one line naming it and evaluates nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from jaxmem import families
from jaxmem.config.flags import add_run_flags, given_overrides
from jaxmem.config.run import flag_names
from jaxmem.data import DataError, load_corpus, resolve_sources
from jaxmem.data.examples import example_options
from jaxmem.io.checkpoint import CheckpointError
from jaxmem.train.evaluate import EvalBatches, evaluate
from jaxmem.train.run import preference_options
from jaxmem.train.rundir import RunError, exit_after_failed_restore, fail
from jaxmem.train.trackers import eval_metrics, plain_progress

PROG = "python -m jaxmem.eval"
HF_BATCH, HF_SEQ = 8, 1024  # --hf's batch shape when not given (--seq-len: at most the model's)
# RunConfig fields this command takes (jaxmem.config.flags): the data and its batch shape, the
# precision, the loss chunk, the quantized base (--hf), the mesh and the progress bar
SECTIONS = ("data", "precision", "remat", "peft", "parallel", "run", "objective")
ONLY = {"data": ("data", "data_field", "chat_template", "train_on", "truncate", "no_pack",
                 "batch_size", "seq_len", "bos_token", "eos_token", "pad_token"),
        "precision": ("mode",), "remat": ("loss_chunk",),
        "peft": ("quantize_base", "quant_block", "double_quant"),
        "parallel": ("mesh",), "run": ("no_progress",)}
HF_ONLY = ("peft.quantize_base", "peft.quant_block", "peft.double_quant", "data.bos_token",
           "data.eos_token", "data.pad_token")
HELP = {  # this command's meaning of the shared flags
    "data.data": "the data to evaluate, all of it, in jaxmem.train's --data forms: text files, a "
                 "directory, a glob, token files, or example rows (.jsonl, .json, .parquet)",
    "data.batch_size": f"sequences per eval batch (default: the run's with --run; {HF_BATCH} "
                       "with --hf)",
    "data.seq_len": f"tokens per sequence (default: the run's with --run; with --hf {HF_SEQ}, or "
                    "the model's max_position_embeddings when smaller)",
    "data.train_on": "example rows: the targets evaluated: the assistant turns / the completion "
                     "(assistant), or every token (all) (default: the run's with --run; assistant "
                     "with --hf)",
    "data.data_field": "example rows: evaluate this string field as plain text (default: the "
                       "run's with --run)",
    "precision.mode": "precision mode: fp32, bf16, amp-bf16, amp-fp16, fp8, bf16-sr, fp8-sr "
                      "(docs/precision.md; default: the run's with --run, fp32 with --hf)",
    "peft.quantize_base": "with --hf: the checkpoint's block projections in int8 or NF4, as a "
                          "QLoRA run stores its base (default: none)",
}


for _name in ("bos", "eos", "pad"):
    HELP[f"data.{_name}_token"] = (f"with --hf: the tokenizer's {_name.upper()} token (default: "
                                   f"the checkpoint's, as jaxmem.train --init-from reads it)")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block (jaxmem.train.rundir.fail)
        fail(self, message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=(
        "Evaluate a run's checkpoint (with --run: its newest, or --step N) or a Hugging Face "
        "checkpoint directory (--hf) on all of --data: mean loss per target token, perplexity, "
        "target tokens, and bits per byte for the byte tokenizer. The batches and the eval "
        "function are jaxmem.train's. With --run, the data, batch and precision flags default "
        "to the run's own values."))
    source = p.add_argument_group("what to evaluate")
    source.add_argument("--run", metavar="DIR", help="run directory (the --out of jaxmem.train); "
                        "a LoRA / QLoRA run is evaluated with its adapters on its base")
    source.add_argument("--hf", metavar="HF_DIR", help="a Hugging Face checkpoint directory (config.json, "
                        "safetensors, tokenizer.json) of a model jaxmem reads: "
                        f"{families.architectures()}")
    source.add_argument("--step", type=int, default=None, metavar="N",
                        help="with --run: evaluate committed checkpoint step N (default: the "
                             "newest)")
    source.add_argument("--json", metavar="FILE", default=None,
                        help="also write the result as JSON to FILE (keys: see the module "
                             "docstring, docs/finetune.md)")
    add_run_flags(p, SECTIONS, only=ONLY)
    for action in p._actions:
        if action.dest in HELP:
            action.help = HELP[action.dest]
    return p


def _check(p, args, overrides: dict) -> None:
    """The flags' combinations, before anything is read."""
    if (args.run is None) == (args.hf is None):
        fail(p, "give one of --run DIR or --hf HF_DIR" + (", not both" if args.run else ""))
    if "data.data" not in overrides:
        fail(p, "--data is required: the files to evaluate")
    if args.step is not None and args.run is None:
        fail(p, "--step needs --run (a Hugging Face checkpoint has one set of weights)")
    for path in HF_ONLY:
        if args.run is not None and path in overrides:
            fail(p, f"{flag_names(path)[0]} is for --hf; a --run is evaluated with its own base "
                    f"and tokenizer")
    if overrides.get("peft.quantize_base", "none") == "none":
        for path in ("peft.quant_block", "peft.double_quant"):
            if path in overrides:
                fail(p, f"{flag_names(path)[0]} needs --quantize-base")
    for flag, value in (("--run", args.run), ("--hf", args.hf)):
        if value is not None and not Path(value).is_dir():
            fail(p, f"{flag} {value}: no such directory")
    if args.json is not None and not Path(args.json).resolve().parent.is_dir():
        fail(p, f"--json {args.json}: no such directory {Path(args.json).resolve().parent}")


@dataclasses.dataclass
class _Job:
    """What one evaluation computes with (built by `_from_run` / `_from_hf`)."""

    cfg: object  # the RunConfig the eval is made from
    step_cfg: object
    tokenizer: object
    placement: object
    params: object = None
    extra: tuple = ()  # the eval function's arguments after the batch (a LoRA base)
    step: int | None = None


def _placement(cfg, model_cfg):
    """One device, or --mesh's mesh (default: all devices on fsdp), as jaxmem.train places."""
    from jaxmem.parallel.mesh import run_mesh  # noqa: PLC0415
    from jaxmem.train.placement import Placement  # noqa: PLC0415

    mesh = run_mesh(cfg.parallel.mesh, model_cfg, cfg.data.batch_size, seq_len=cfg.data.seq_len)
    return Placement.single() if mesh is None else Placement.on(mesh, cfg.peft.offload_base)


def _fp8_flags(precision) -> None:
    """fp8 GEMMs need XLA flags set before JAX's backend starts (jaxmem.model.fp8_compile)."""
    if precision.fp8_gemms:
        from jaxmem.model.fp8_compile import set_xla_flags  # noqa: PLC0415
        set_xla_flags()


def _set_up(cfg):
    """(ModelConfig, StepConfig, loss scale, placement) of `cfg`."""
    from jaxmem.train.run import build_step_config  # noqa: PLC0415

    _fp8_flags(cfg.precision)
    model_cfg, step_cfg, loss_scale = build_step_config(cfg)
    return model_cfg, step_cfg, loss_scale, _placement(cfg, model_cfg)


def _on_devices(par, params, like):
    """`params` (host or one device) placed as the train state's params (`like`: a state or
    its abstract form) on the placement's mesh; on one device, on the default device."""
    import jax  # noqa: PLC0415

    if par.mesh is None:
        return jax.device_put(params)
    return jax.device_put(params, par.state_shardings(like).params)


def _from_run(args, overrides: dict) -> _Job:
    """A run's checkpoint with its config, the flags given applied (data, batch, precision)."""
    from jaxmem.train.rundir import load_run, read_run_config  # noqa: PLC0415

    saved, _ = read_run_config(Path(args.run))
    _fp8_flags(saved.replace(overrides).precision)  # before the restore
    run = load_run(Path(args.run), step=args.step)
    # the mesh and the progress bar are this invocation's, never the run's
    cfg = run.config.replace({"parallel.mesh": None, "run.no_progress": False, **overrides})
    model_cfg, step_cfg, _, par = _set_up(cfg)
    frozen, _ = step_cfg.trainable.prepare_frozen(  # LoRA: its base (checked), as trained on
        cfg, model_cfg, step_cfg, run.record, cfg.init.init_from, par.base_shardings(step_cfg))
    return _Job(cfg, step_cfg, run.tokenizer, par, _on_devices(par, run.state.params, run.state),
                step_cfg.trainable.step_args(frozen), int(run.state.step))


def _from_hf(args, overrides: dict) -> _Job:
    """A Hugging Face checkpoint: its model and tokenizer; weights in the precision's storage
    dtype, or (--quantize-base) its quantized base under zero rank-1 adapters."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxmem.config.run import RunConfig  # noqa: PLC0415
    from jaxmem.io.hf import hf_tokenizer, load_hf_params  # noqa: PLC0415
    from jaxmem.train.init_from import init_from_overrides  # noqa: PLC0415
    from jaxmem.train.run import abstract_train_state  # noqa: PLC0415

    # the checkpoint's model section and tokenizer, as jaxmem.train --init-from takes them
    given = init_from_overrides({**overrides, "init.init_from": args.hf})
    hf_dir = given["init.init_from"]
    shape = {"data.batch_size": HF_BATCH,
             "data.seq_len": min(HF_SEQ, given["model.max_position_embeddings"])}
    quantized = overrides.get("peft.quantize_base", "none") != "none"
    lora = {"peft.lora_rank": 1, "peft.lora_targets": "q"} if quantized else {}
    cfg = RunConfig().replace({**shape, **lora, **given})
    d = cfg.data
    tokenizer = hf_tokenizer(hf_dir, bos_token=d.bos_token, eos_token=d.eos_token,
                             pad_token=d.pad_token)
    model_cfg, step_cfg, loss_scale, par = _set_up(cfg)
    like = abstract_train_state(step_cfg, loss_scale, d.seed)
    trainable = step_cfg.trainable
    if quantized:  # B = 0: the adapters add exactly nothing to the quantized base
        frozen, _ = trainable.prepare_frozen(cfg, model_cfg, step_cfg, None, hf_dir,
                                             par.base_shardings(step_cfg))
        params = trainable.init_params(model_cfg, jax.random.PRNGKey(d.seed),
                                       step_cfg.precision.param_dtype)
    else:
        frozen = None
        params = load_hf_params(hf_dir, model_cfg, np.dtype(step_cfg.precision.param_dtype))
    return _Job(cfg, step_cfg, tokenizer, par, _on_devices(par, params, like),
                trainable.step_args(frozen))


def _batches(job: _Job, data: str) -> EvalBatches:
    """All of `data`, as the trainer batches an eval split (its example options: masks,
    packing, truncation, chat template)."""
    d = job.cfg.data
    if job.step_cfg.objective.reference and job.extra == ():
        raise RunError("this run is a full fine-tune with DPO: its reference is its step-0 "
                       "model's log-probs, precomputed on its own data only; evaluate it with "
                       "--objective orpo or simpo, or evaluate a LoRA DPO run (its reference "
                       "is its base)")
    options = {**example_options(d), "eval_data": None,
               **preference_options(job.cfg, job.step_cfg)}
    tokens, _, _ = load_corpus(data, job.tokenizer, job.step_cfg.model.vocab_size,
                               eval_fraction=0.0, seq_len=d.seq_len, **options)
    return EvalBatches(tokens, d.batch_size, d.seq_len, job.tokenizer.pad_id)


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    overrides = given_overrides(args)
    _check(p, args, overrides)
    try:
        resolve_sources(overrides["data.data"])  # a missing file fails before any weights load
        job = (_from_run if args.run is not None else _from_hf)(args, overrides)
        batches = _batches(job, overrides["data.data"])
        if not len(batches):
            raise DataError(f"--data {overrides['data.data']}: nothing to evaluate (fewer than 2 "
                            f"tokens)")
    except CheckpointError as e:
        exit_after_failed_restore(p, str(e).splitlines()[0])
    except (RunError, DataError, ValueError) as e:  # HFError, ConfigError, MeshError ...
        fail(p, str(e).splitlines()[0] if str(e) else repr(e))
    result, seconds = _evaluate(job, batches, args)
    _report(p, args, job, result, seconds, overrides["data.data"])
    return 0


def _evaluate(job: _Job, batches: EvalBatches, args):
    """The trainer's eval function over every batch; a progress bar on a terminal."""
    from tqdm import tqdm  # noqa: PLC0415

    par = job.placement
    eval_fn = par.eval_fn(job.step_cfg)
    bar = tqdm(total=len(batches), unit="batch", desc="eval", file=sys.stderr, dynamic_ncols=True,
               disable=plain_progress(job.cfg.run.no_progress, sys.stderr))
    t0 = time.perf_counter()
    with bar:
        result = evaluate(eval_fn, job.params, batches, job.extra, par.eval_batch, par.host,
                          bar.update, objective=job.step_cfg.objective)
    return result, time.perf_counter() - t0


def _report(p, args, job: _Job, result, seconds: float, data: str) -> None:
    """The result line on stdout, and --json's file."""
    metrics = result.metrics or {k[len("eval_"):]: v for k, v in  # preference: its rewards
                                 eval_metrics(result.loss, job.tokenizer.name == "bytes").items()}
    d, mode, mesh = job.cfg.data, job.cfg.precision.mode, job.placement.mesh
    axes = None if mesh is None else {a: n for a, n in dict(mesh.shape).items() if n > 1}
    source = (f"{args.run} (step {job.step})" if args.run is not None else args.hf)
    shown = "".join(f", {k.replace('_', ' ')} {v:.4g}" for k, v in metrics.items())
    where = "" if axes is None else ", mesh " + ",".join(f"{a}={n}" for a, n in axes.items())
    unit = job.step_cfg.objective.unit
    counted = "target tokens" if unit == "tokens" else unit
    print(f"eval: {source} on {data}: loss {result.loss:.4f}{shown}; {result.tokens:,} {counted} in {result.batches} batch{'es' if result.batches != 1 else ''} of "
          f"{d.batch_size} x {d.seq_len} ({mode}{where}), "
          f"{seconds:.1f} s", flush=True)
    if args.json is None:
        return
    record = {"loss": result.loss, **metrics, "tokens": result.tokens,
              "batches": result.batches, "batch_size": d.batch_size, "seq_len": d.seq_len,
              "source": "run" if args.run is not None else "hf",
              "path": args.run if args.run is not None else args.hf, "step": job.step,
              "data": data, "precision": mode, "quantize_base": job.cfg.peft.quantize_base,
              "mesh": axes, "seconds": round(seconds, 3)}
    try:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    except OSError as e:
        fail(p, f"--json {args.json}: {e.strerror or e}")
