"""Writing a Hugging Face checkpoint directory of a registered family that transformers loads.

    save_hf(out, config, params, dtype=..., max_shard_bytes=..., tokenizer=...)

Writes `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus
`model.safetensors.index.json` when the weights exceed `max_shard_bytes` (default 2 GiB: a
llama-3.2-1b in bf16 is one file, an 8B four shards); `config.json` from
jaxmem.io.hf.config_to_hf; and the tokenizer files found next to the run's tokenizer.json.

Tensors are converted and written one at a time (jaxmem.io.hf_names.hf_state_items,
write_safetensors), so the host holds at most one tensor beyond the params. The shards are planned from the tensor
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

from jaxmem.families.config import ModelConfig
from jaxmem.data.special_tokens import GENERATION_CONFIG, TOKENIZER_FILES
from jaxmem.io.hf import CONFIG, INDEX, TOKENIZER, WEIGHTS, HFError, config_to_hf
from jaxmem.io.hf_names import hf_names, hf_state_items, tensor_shapes

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
DEFAULT_MAX_SHARD_BYTES = 2 << 30


def _plan_shards(config: ModelConfig, itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    """HF names grouped into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    sizes = {name: math.prod(shape) * itemsize for name, shape in tensor_shapes(config).items()}
    shards, current, used = [], [], 0
    for name in hf_names(config):
        if current and used + sizes[name] > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += sizes[name]
    return shards + [current]


# numpy dtype name -> safetensors' dtype code
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def write_safetensors(path, names: list[str], shapes: dict, dtype, arrays) -> int:
    """Write one .safetensors file tensor by tensor: the header is made from `shapes` first,
    then each array of the iterator `arrays` (in `names` order) is cast and appended, so only
    one tensor is held at a time. Returns the data bytes written.

    safetensors' format: an 8-byte little-endian header length, a JSON header ({name: {dtype,
    shape, data_offsets}}, padded with spaces to 8 bytes) and the tensors' bytes back to back.
    """
    dtype = np.dtype(dtype)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        size = math.prod(shapes[name]) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype.name], "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, array in zip(names, arrays):
            a = np.ascontiguousarray(np.asarray(array).astype(dtype, copy=False))
            if tuple(a.shape) != tuple(shapes[name]):
                raise HFError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shapes[name])}")
            f.write(a.reshape(-1).view(np.uint8).data)  # no copy of the tensor's bytes
    return offset


def save_hf(out, config: ModelConfig, params, dtype: str = "float32",
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: str | None = None,
            bos_token_id: int | None = None, eos_token_id=None, pad_token_id: int | None = None,
            items=None) -> list[Path]:
    """Write params (jaxmem layout; arrays, no weight objects) as an HF directory; returns files.

    tokenizer: path of a tokenizer.json; it and its sibling files (TOKENIZER_FILES) are copied.
    bos_token_id, eos_token_id (an id or a list of stop ids), pad_token_id: config.json's, and
        a generation_config.json's of these ids where the tokenizer brought none.
    items: instead of params, an iterator of (HF name, HF-layout array) in hf_names order (a
        merged LoRA export computes each tensor as it is written: jaxmem.export.merged).
    Each tensor is written as it comes (write_safetensors): the host holds one tensor beyond
    what `params` / `items` hold.
    """
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
    items = hf_state_items(config, params) if items is None else iter(items)
    shapes = tensor_shapes(config)  # a fused tensor's whole shape (its parts joined)

    def arrays(shard):
        for name in shard:
            got, array = next(items)
            assert got == name, (got, name)  # the plan and the items follow hf_names' order
            yield array
    weight_map, written, total = {}, [], 0
    for shard, file in zip(shards, names):
        total += write_safetensors(out / file, shard, shapes, np_dtype, arrays(shard))
        weight_map.update({name: file for name in shard})
        written.append(out / file)
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
    ids = {k: v for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id),
                             ("pad_token_id", pad_token_id)) if v is not None}
    if ids and not (out / GENERATION_CONFIG).exists():  # transformers' generate stops at its ids
        (out / GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n")
        written.append(out / GENERATION_CONFIG)
    d = config_to_hf(config, dtype, bos_token_id, eos_token_id, pad_token_id)
    (out / CONFIG).write_text(json.dumps(d, indent=2))
    return written + [out / CONFIG]
