"""Writing a Hugging Face Llama checkpoint directory that transformers loads.

    save_hf(out, config, params, dtype=..., max_shard_bytes=..., tokenizer=...)

Writes `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus
`model.safetensors.index.json` when the weights exceed `max_shard_bytes` (default 2 GiB: a
llama-3.2-1b in bf16 is one file, an 8B four shards); `config.json` from
jaxmem.io.hf.config_to_hf; and the tokenizer files found next to the run's tokenizer.json.

Tensors are converted and written one shard at a time (jaxmem.io.hf_names.hf_state_items), so
the host holds at most one shard beyond the params. The shards are planned from the tensor
shapes before anything is written, so every file name carries the final shard count, as
transformers' `save_pretrained` names them. Nothing is written into a directory that already
holds a checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import ml_dtypes  # noqa: F401  (bfloat16 for numpy)
import numpy as np

from jaxmem.config.model import ModelConfig
from jaxmem.io.hf import CONFIG, INDEX, TOKENIZER, WEIGHTS, HFError, config_to_hf
from jaxmem.io.hf_names import hf_state_items, tensor_specs

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
DEFAULT_MAX_SHARD_BYTES = 2 << 30
# Files of a Hugging Face tokenizer that are copied along with tokenizer.json when present.
TOKENIZER_FILES = (TOKENIZER, "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def _plan_shards(config: ModelConfig, itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    """HF names grouped into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    sizes = {}
    for s in tensor_specs(config):
        for i in range(config.num_layers) if s.stacked else [None]:
            sizes[s.name(i)] = math.prod(s.hf_shape) * itemsize
    from jaxmem.io.hf_names import hf_names  # noqa: PLC0415

    shards, current, used = [], [], 0
    for name in hf_names(config):
        if current and used + sizes[name] > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += sizes[name]
    return shards + [current]


def save_hf(out, config: ModelConfig, params, dtype: str = "float32",
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: str | None = None,
            bos_token_id: int | None = None, eos_token_id: int | None = None) -> list[Path]:
    """Write params (jaxmem layout; arrays, no weight objects) as an HF directory; returns files.

    tokenizer: path of a tokenizer.json; it and its sibling files (TOKENIZER_FILES) are copied.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415

    if dtype not in DTYPES:
        raise HFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out)
    if (out / CONFIG).exists() or list(out.glob("*.safetensors")):
        raise HFError(f"{out} already holds a checkpoint; choose another directory "
                      f"(nothing was written)")
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(DTYPES[dtype])
    shards = _plan_shards(config, np_dtype.itemsize, max_shard_bytes)
    names = [WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    items = hf_state_items(config, params)
    weight_map, written, total = {}, [], 0
    for shard, file in zip(shards, names):
        tensors = {}
        for name in shard:
            got, array = next(items)
            assert got == name, (got, name)  # the plan and the items follow hf_names' order
            tensors[name] = np.ascontiguousarray(array.astype(np_dtype))
            total += tensors[name].nbytes
            weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        written.append(out / file)
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2))
        written.append(out / INDEX)
    if tokenizer is not None:
        for file in TOKENIZER_FILES:
            src = Path(tokenizer).parent / file if file != TOKENIZER else Path(tokenizer)
            if src.is_file():
                shutil.copyfile(src, out / file)
                written.append(out / file)
    d = config_to_hf(config, dtype, bos_token_id, eos_token_id)
    (out / CONFIG).write_text(json.dumps(d, indent=2))
    return written + [out / CONFIG]
