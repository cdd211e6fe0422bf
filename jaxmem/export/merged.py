"""A LoRA run's merged export, streamed: each HF tensor is read from the original base, merged
with its layer's adapters and written before the next one is read, so the host never holds the
whole 16-bit model (an 8B bf16 merge holds one tensor, at most the 1 GB embedding, where
jaxmem.peft.export.merged_params holds the merged model in fp32, 32 GB).

    python -m jaxmem.export --run runs/qlora --out hf/merged     # a LoRA run: this path

    items = merged_items(run, source)   # (HF name, HF-layout fp32 array), in hf_names order
    export_merged(run, out, args)       # checked base, items -> save_hf(items=...)

The base is the run's original one (jaxmem.peft.export explains why never the NF4 copy): the
--init-from checkpoint read in place, one tensor at a time (jaxmem.peft.slices.HFSlices), or a
seed's random init (computed whole on the host: it has no file to stream from). Its sha256 is
streamed too and checked against the run's record before anything is written. Each merged tensor
is W + alpha/r A B computed by jaxmem.peft.export.merge for that layer alone (the same einsum as
the whole-model merge). Adapters sharded over several processes are all-gathered first (they are
small: `gathered_adapters`), and process 0 writes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxmem.io.hf_export import save_hf
from jaxmem.io.hf_names import by_tensor, hf_names, join_parts
from jaxmem.peft.slices import HFSlices, HostSlices, streamed_sha256
from jaxmem.peft.base import base_on_host, check_base
from jaxmem.peft.export import gathered_adapters
from jaxmem.families.names import PROJECTIONS as TARGETS
from jaxmem.peft.export import merge


def base_source(run):
    """(source name, HFSlices / HostSlices) of a LoRA run's original base, its sha256 checked
    against the run's record (ValueError naming both when it differs)."""
    init_from = run.config.init.init_from
    if init_from:
        source, name = HFSlices(init_from), str(init_from)
    else:
        name, host = base_on_host(run.model_config, run.config.data.seed, None)
        source = HostSlices(host)
    check_base(run.record, name, streamed_sha256(source, run.model_config))
    return name, source


def merged_items(run, source, adapters=None):
    """(HF name, HF-layout fp32 array) of the merged model, one tensor at a time, hf_names order.

    Targets are W + alpha/r A B (jaxmem.peft.export.merge on that layer); the other tensors are the
    base's, as stored. A fused tensor (TensorSpec.part) is its parts, each merged with its own
    projection's adapters, joined. adapters: gathered_adapters(run.state.params), made here when
    None.
    """
    cfg = run.model_config
    adapters = gathered_adapters(run.state.params) if adapters is None else adapters
    tensors = by_tensor(cfg)
    for name in hf_names(cfg):
        members, i = tensors[name]
        yield name, join_parts(members, [_merged_part(run, source, adapters, s, i)
                                         for s in members])


def _merged_part(run, source, adapters, s, i):
    """One param's HF-layout array (of layer i): the base's, merged where it is a target."""
    spec, cfg = run.step_config.trainable, run.model_config
    short = {TARGETS[t]: t for t in spec.targets}  # (group, pname) -> --lora-targets name
    whole = tuple(slice(0, n) for n in s.hf_shape)
    w = source.hf_slice(s, i, whole)  # HF layout, the base's dtype
    key = tuple(s.path[1:]) if s.stacked else None
    if key not in short:
        return w
    layer_w = w.T.reshape(s.shape)[None]  # [1, in..., out...], jaxmem's layout
    ad = {k: v[i:i + 1] for k, v in adapters["layers"][key[0]][key[1]].items()}
    one = dataclasses.replace(spec, targets=(short[key],))
    merged = merge({"layers": {key[0]: {key[1]: layer_w}}},
                   {"layers": {key[0]: {key[1]: ad}}}, one, cfg)
    return np.ascontiguousarray(merged["layers"][key[0]][key[1]][0].reshape(
        -1, w.shape[0]).T)  # back to HF's [out, in]


def export_merged(run, out: Path, args) -> list[Path]:
    """Write a LoRA run's merged weights (+ config.json, tokenizer files) into `out`, streamed."""
    import jax  # noqa: PLC0415

    spec = run.step_config.trainable
    adapters = gathered_adapters(run.state.params)  # a collective when they span processes
    if jax.process_index() != 0:  # process 0 writes
        return []
    name, source = base_source(run)
    print(f"merging LoRA r={spec.rank} (alpha {spec.alpha:g}) into the original base weights of "
          f"{name} (sha256 {run.record['peft_base']['sha256'][:16]}...), tensor by tensor"
          + (f", not the {spec.quantize} copy the run trained on" if spec.quantize != "none"
             else ""))
    dtype = args.dtype or np.dtype(source.dtype).name
    return write_hf(run, out, args, None, dtype, items=merged_items(run, source, adapters))


def write_hf(run, out, args, params, dtype: str, items=None):
    """`save_hf` of a run: its config, `params` (or the streamed `items`) in `dtype`, shards of
    `--max-shard-mb`, and its tokenizer files (none for jaxmem's byte-level tokenizer: said)."""
    tok = run.tokenizer
    tokenizer = getattr(tok, "path", None)
    if tokenizer is None:
        print(f"{out}: no tokenizer files written: the run uses jaxmem's byte-level tokenizer, "
              "which transformers does not have")
    bos, eos, pad = export_token_ids(tok)
    return save_hf(out, run.model_config, params, dtype=dtype,
                   max_shard_bytes=int(args.max_shard_mb * 2**20), tokenizer=tokenizer,
                   bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, items=items)


def export_token_ids(tok) -> tuple:
    """(bos_token_id, eos_token_id, pad_token_id) for an export's config.json: the checkpoint's
    generation config's where the run keeps one (its generation_config.json is copied as it is),
    else the tokenizer's BOS and its stop ids (one id, or the list), so the export stops where
    the original stops; a PAD only where the checkpoint's generation config names one."""
    gen = getattr(tok, "generation_ids", {}) or {}
    stops = list(getattr(tok, "stop_ids", ()) or [tok.eos_id])
    eos = gen.get("eos_token_id", stops[0] if len(stops) == 1 else stops)
    return gen.get("bos_token_id", tok.bos_id), eos, gen.get("pad_token_id")
