"""Hugging Face checkpoint directories of the registered families (jaxmem.families: Llama,
Qwen3, Qwen2 / Qwen2.5, Mistral): the config mapping and reading the weights.

    config_from_hf(d) -> ModelConfig      config.json's dict -> ModelConfig (refuses what it
                                          cannot represent, naming the key)
    config_to_hf(config, ...) -> dict     ModelConfig -> config.json's dict (transformers loads it)
    read_hf_config(dir) -> dict           config.json of a checkpoint directory
    load_hf_params(dir, config, dtype)    the jaxmem params tree, read tensor by tensor
    load_hf(dir, dtype) -> (ModelConfig, params)
    hf_tokenizer(dir)                     the checkpoint's tokenizer (jaxmem.data.load_tokenizer)

numpy + safetensors + ml_dtypes only (no torch). The two config mappings are the one reviewed
place where jaxmem's ModelConfig meets a transformers config (each family adds its keys;
levanter's from_hf_config / to_hf_config): import and export use nothing else, and
tests/test_hf.py round-trips both.

config.json comes in two spellings. transformers <= 4 wrote `rope_theta`, `rope_scaling`
({"rope_type" or "type": "llama3", "factor": ...} or null) and `torch_dtype`; transformers 5
writes `rope_parameters` ({"rope_type", "rope_theta", ...}) and `dtype`. Both are read; export
writes both rope spellings (`rope_theta` + `rope_scaling` and `rope_parameters`), which 4.x and
5.x read alike.

Weights are read with safetensors' `safe_open`, one tensor at a time, into arrays allocated once
per jaxmem parameter (jaxmem.io.hf_names.params_from_hf), so an 8B checkpoint needs one host copy
of the model in the target dtype plus one tensor. bf16 files need `ml_dtypes` imported before
safetensors builds a numpy array of them (it is imported here).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors reads bf16)
import numpy as np

from jaxmem import families
from jaxmem.errors import ConfigError
from jaxmem.families.config import ModelConfig
from jaxmem.families.names import EMBEDDING
from jaxmem.io.hf_names import hf_names, params_from_hf, spec_for

CONFIG, WEIGHTS, INDEX, TOKENIZER = ("config.json", "model.safetensors",
                                     "model.safetensors.index.json", "tokenizer.json")


class HFError(ValueError):
    """A Hugging Face checkpoint directory jaxmem cannot use; the message names file/key/tensor."""


# ----------------------------------------------------------------------------- config mapping

# ModelConfig field <- config.json key (the plain one-to-one part every family shares).
_SAME = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
         "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
         "num_heads": "num_attention_heads", "max_position_embeddings": "max_position_embeddings",
         "rms_norm_eps": "rms_norm_eps"}
_LLAMA3_KEYS = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                "rope_high_freq_factor": "high_freq_factor",
                "rope_original_max_position_embeddings": "original_max_position_embeddings"}


def _refuse(d: dict, key: str, ok, what: str) -> None:
    try:
        families.refuse(d, key, ok, what)
    except ConfigError as e:
        raise HFError(str(e)) from None


def _rope(d: dict) -> dict:
    """RoPE's ModelConfig fields from either spelling (rope_parameters, or rope_theta + rope_scaling)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # per-layer-type form {"full_attention": {...}, "sliding_attention": {...}}: the full
        # layers' here, the local layers' base is the family's (Gemma 3)
        params = params.get("full_attention") or next(iter(params.values()))
    params = dict(params or {})
    scaling = d.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    key = "rope_parameters" if "rope_type" in params else "rope_scaling"
    if rope_type not in ("default", "llama3", "linear"):
        raise HFError(f"config.json: {key}.rope_type={rope_type!r} is not supported "
                      f"(jaxmem implements 'default', 'llama3' and 'linear')")
    src = {**scaling, **params}
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "llama3":
        for field, hf_key in _LLAMA3_KEYS.items():
            if hf_key not in src:
                raise HFError(f"config.json: {key} has rope_type 'llama3' but no {hf_key}")
            out[field] = src[hf_key]
    if rope_type == "linear":
        if "factor" not in src:
            raise HFError(f"config.json: {key} has rope_type 'linear' but no factor")
        out["rope_factor"] = float(src["factor"])
    return out


# config.json's hidden_act / hidden_activation -> ModelConfig.mlp_activation
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(d: dict, note=None) -> ModelConfig:
    """ModelConfig of a config.json dict of a registered family (jaxmem.families); HFError
    names the first key it cannot take. note(msg) is told what a multimodal checkpoint's import
    leaves out (Gemma 3's vision tower)."""
    try:
        family, d, left_out = families.text_decoder(d)
    except ConfigError as e:
        raise HFError(str(e)) from None
    if left_out and note is not None:
        note(left_out)
    _refuse(d, "attention_bias", lambda v: v is False, "no biases in jaxmem's attention")
    _refuse(d, "mlp_bias", lambda v: v is False, "no biases in jaxmem's MLP")
    act_key = "hidden_activation" if d.get("hidden_activation") else "hidden_act"
    _refuse(d, act_key, lambda v: v in _ACTIVATIONS,
            f"jaxmem's gated MLP takes {' or '.join(_ACTIVATIONS)}")
    _refuse(d, "attention_dropout", lambda v: v == 0, "jaxmem has no dropout")
    if d.get("quantization_config"):  # GPTQ / AWQ / bitsandbytes files: not plain weights
        method = d["quantization_config"].get("quant_method", "?") if isinstance(
            d["quantization_config"], dict) else "?"
        raise HFError(f"config.json: quantization_config (quant_method {method!r}) is not "
                      f"supported: jaxmem reads unquantized weights (--quantize-base quantizes)")
    missing = [k for k in _SAME.values() if k not in d and k != "rms_norm_eps"]
    if missing:
        raise HFError(f"config.json: missing key {missing[0]}")
    fields = {f: d[k] for f, k in _SAME.items() if k in d}
    fields["num_kv_heads"] = d.get("num_key_value_heads") or d["num_attention_heads"]
    head_dim = d.get("head_dim")
    if head_dim and head_dim * d["num_attention_heads"] != d["hidden_size"]:
        fields["head_dim"] = head_dim  # else derived, as ModelConfig does
    fields["tie_embeddings"] = bool(d.get("tie_word_embeddings", False))
    fields["mlp_activation"] = _ACTIVATIONS[d.get(act_key) or "silu"]
    fields.update(_rope(d))
    try:
        fields.update(family=family.name, **family.fields(d))  # its refusals name their key
    except ConfigError as e:
        raise HFError(str(e)) from None
    if "partial_rotary_factor" not in fields:  # a family that reads it returns it (Phi-3)
        for src in (d, d.get("rope_parameters"), d.get("rope_scaling")):
            if isinstance(src, dict):
                _refuse(src, "partial_rotary_factor", lambda v: v == 1,
                        f"RoPE on the whole head only for {family.name}")
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise HFError(f"config.json: {e}") from None


def hf_dtype_name(d: dict) -> str:
    """The checkpoint's dtype name ("bfloat16", "float32", ...) from `dtype` or `torch_dtype`."""
    return str(d.get("dtype") or d.get("torch_dtype") or "float32").removeprefix("torch.")


def config_to_hf(c: ModelConfig, dtype: str = "float32", bos_token_id: int | None = None,
                 eos_token_id=None, pad_token_id: int | None = None) -> dict:
    """config.json's dict for the transformers model of `c`'s family equal to `c`."""
    family = families.get(c.family)
    act = {v: k for k, v in _ACTIVATIONS.items()}[c.mlp_activation]
    d = {"architectures": [family.architecture], "model_type": family.hf_model_type,
         **{k: getattr(c, f) for f, k in _SAME.items()},
         "num_key_value_heads": c.num_kv_heads, "head_dim": c.resolved_head_dim,
         "hidden_act": act, "attention_bias": False,
         "attention_dropout": 0.0, "tie_word_embeddings": c.tie_embeddings,
         "rope_theta": c.rope_theta, "rope_scaling": None,
         "rope_parameters": {"rope_type": c.rope_type, "rope_theta": c.rope_theta},
         "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
         "dtype": dtype, "torch_dtype": dtype}
    if c.rope_type == "llama3":
        llama3 = {k: getattr(c, f) for f, k in _LLAMA3_KEYS.items()}
        d["rope_scaling"] = {"rope_type": "llama3", **llama3}
        d["rope_parameters"].update(llama3)
    d.update(family.hf_keys(c))  # a family's spelling of a shared key wins (Gemma's RoPE)
    if pad_token_id is not None:  # the run's own id wins over a family's default (Phi-3's None)
        d["pad_token_id"] = pad_token_id
    return d


def read_hf_config(hf_dir) -> dict:
    """config.json of a checkpoint directory (HFError naming the file when it cannot)."""
    path = Path(hf_dir) / CONFIG
    if not Path(hf_dir).is_dir():
        raise HFError(f"{hf_dir}: not a directory")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{hf_dir}: no {CONFIG} (not a Hugging Face checkpoint directory)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise HFError(f"{path}: unreadable ({e})") from None


# ----------------------------------------------------------------------------- weights

def weight_files(hf_dir) -> dict[str, Path]:
    """{tensor name: the .safetensors file holding it} (index.json, or the single file)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFError(f"{index}: unreadable index ({type(e).__name__}: {e})") from None
        for file in sorted(set(weight_map.values())):
            if not (hf_dir / file).is_file():
                raise HFError(f"{index} names shard {file}, which is missing")
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = hf_dir / WEIGHTS
    if not single.is_file():
        raise HFError(f"{hf_dir}: no {WEIGHTS} or {INDEX} (weights in safetensors format)")
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}


class _TensorReader:
    """get_tensor(name) over a checkpoint's files.

    Each read opens the file, copies the one tensor out and closes it: safetensors reads through
    a memory map, and a file kept open keeps every page read so far resident, which added the
    file's size to the peak (measured: experiments/tables/hf_load_memory.py).
    """

    def __init__(self, files: dict[str, Path], hf_dir):
        self.files, self.hf_dir = files, hf_dir
        self.stored: dict[str, str] = {}  # a name as read -> as stored (`nest`)

    def nest(self, prefix: str) -> None:
        """Read the tensors under `prefix` (a multimodal checkpoint's language model) as the
        causal LM's `model.` ones; the rest (its vision tower) is left out."""
        names = [n for n in self.files if n.startswith(prefix)]
        self.stored = {"model." + n.removeprefix(prefix): n for n in names}
        self.files = {"model." + n.removeprefix(prefix): self.files[n] for n in names}

    def __call__(self, name: str) -> np.ndarray:
        from safetensors import safe_open  # noqa: PLC0415

        if name not in self.files:
            raise HFError(f"{self.hf_dir}: no tensor {name} in the checkpoint's weights")
        with safe_open(self.files[name], framework="numpy") as f:
            return f.get_tensor(self.stored.get(name, name))


def load_hf_params(hf_dir, config: ModelConfig, dtype=np.float32) -> dict:
    """The params tree of `config` (numpy, `dtype`) from the directory's safetensors files.

    A missing tensor or shard, or a tensor of the wrong shape, raises HFError naming it.
    Tensors the model does not use (a tied checkpoint's lm_head.weight) are not read.
    """
    reader = _TensorReader(weight_files(hf_dir), hf_dir)
    prefixes = families.get(config.family).prefixes
    embed = spec_for(config, (EMBEDDING,)).name().removeprefix("model.")  # under any prefix
    found = [p for p in prefixes if p + embed in reader.files]
    if found and found[0] != "model.":
        reader.nest(found[0])
    try:
        missing = [n for n in hf_names(config) if n not in reader.files]
        if missing:
            raise HFError(f"{hf_dir}: no tensor {missing[0]} in the checkpoint's weights"
                          + (f" ({len(missing)} missing)" if len(missing) > 1 else ""))
        return params_from_hf(config, reader, dtype)
    except ValueError as e:
        if isinstance(e, HFError):
            raise
        raise HFError(f"{hf_dir}: {e}") from None  # a tensor of the wrong shape, named


def load_hf(hf_dir, dtype=np.float32, note=None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a Hugging Face checkpoint directory (note: config_from_hf's)."""
    config = config_from_hf(read_hf_config(hf_dir), note)
    return config, load_hf_params(hf_dir, config, dtype)


# ----------------------------------------------------------------------------- tokenizer

def hf_tokenizer(hf_dir, bos_token=None, eos_token=None, pad_token=None):
    """The checkpoint's tokenizer (jaxmem.data.tokenizers.load_tokenizer: its tokenizer.json,
    special tokens, chat template and stop ids as its own files say), HFError naming the file
    when it cannot be loaded."""
    from jaxmem.data.errors import DataError  # noqa: PLC0415
    from jaxmem.data.tokenizers import load_tokenizer  # noqa: PLC0415

    if not (Path(hf_dir) / TOKENIZER).is_file():
        raise HFError(f"{hf_dir}: no {TOKENIZER}")
    try:
        return load_tokenizer(hf_dir, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token)
    except DataError as e:
        raise HFError(str(e)) from None
