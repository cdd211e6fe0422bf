"""Which Hugging Face tensor each jaxmem parameter is, and how its layout differs.

    tensor_specs(config)                 one TensorSpec per jaxmem param path (the whole table)
    spec_for(config, path)               the TensorSpec of one jaxmem param path
    hf_names(config)                     every HF tensor name the model has, in file order
    tensor_shapes(config)                {HF name: shape} (a fused tensor's whole shape)
    to_hf(spec, w) / from_hf(spec, w)    one tensor (one layer's slice when stacked) between layouts
    hf_state_items(config, params)       (hf_name, array) pairs, one layer slice at a time
    params_from_hf(config, get_tensor)   the jaxmem params tree, filled tensor by tensor

jaxmem stores the decoder blocks stacked: params['layers']['self_attn']['q_proj'] has shape
[L, D, N, H], where Hugging Face has one tensor per layer, `model.layers.{i}.self_attn.q_proj.weight`
of shape [N*H, D] (PyTorch's nn.Linear keeps weights as [out, in]). Every projection converts
the same way: jaxmem's weight is [in axes..., out axes...] (the einsum's operand order), so
flattening it to [in, out] and transposing gives HF's [out, in]. `in_ndim` says how many leading
axes are input axes (o_proj [N, H, D] has two). Norm scales and the embedding are identical in
both layouts; the untied LM head is [D, V] here and `lm_head.weight` [V, D] there.

HF Llama's q/k weights are already in the rotate_half layout jaxmem's RoPE uses (halves, not
interleaved pairs; transformers converts Meta's checkpoints on import), so there is no
permutation of the head dim: tests/test_hf.py shows that one breaks parity.

A family's table may store several params in one HF tensor (`TensorSpec.part`: Phi-3's fused
qkv_proj / gate_up_proj): each is a slice along one HF axis; reading cuts the tensor (read once)
into its params, writing concatenates them.

LoRA adapters (PEFT layout) name a projection by its module name, `TensorSpec.module(i)`
(e.g. `model.layers.3.self_attn.q_proj`); lora_A is [r, in] and lora_B [out, r], with in/out the
products of the axes split by `in_ndim`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator

import numpy as np

from jaxmem import families
from jaxmem.families.config import ModelConfig
from jaxmem.families.names import EMBEDDING, TensorSpec, tensor_groups  # TensorSpec: re-exported


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every jaxmem parameter of `config` with its HF counterpart, in HF's usual file order:
    the family's table (jaxmem.families: its `tensors`, the shared decoder's by default)."""
    return families.get(config.family).tensor_specs(config)


def spec_for(config: ModelConfig, path: tuple[str, ...]) -> TensorSpec:
    """The TensorSpec of the jaxmem param at `path` (KeyError naming it if there is none)."""
    for spec in tensor_specs(config):
        if spec.path == tuple(path):
            return spec
    raise KeyError(f"no jaxmem parameter at {'/'.join(path)}")


def hf_names(config: ModelConfig) -> list[str]:
    """Every HF tensor name of the model (layer-major within the blocks), e.g. for an index; a
    fused tensor (several params' parts, TensorSpec.part) once."""
    groups = tensor_groups(tensor_specs(config))
    first = [g[0] for g in groups.values()]
    names = [s.name() for s in first if not s.stacked and s.path == (EMBEDDING,)]
    for i in range(config.num_layers):
        names += [s.name(i) for s in first if s.stacked]
    names += [s.name() for s in first if not s.stacked and s.path != (EMBEDDING,)]
    return names


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: its shape} (a fused tensor's whole shape), as `hf_names` lists them."""
    return {s.name(i): s.tensor_shape for s in tensor_specs(config)
            for i in (range(config.num_layers) if s.stacked else [None])}


def by_tensor(config: ModelConfig) -> dict[str, tuple[list[TensorSpec], int | None]]:
    """{HF tensor name: (the specs stored in it, the layer or None)}."""
    out = {}
    for members in tensor_groups(tensor_specs(config)).values():
        for i in range(config.num_layers) if members[0].stacked else [None]:
            out[members[0].name(i)] = (members, i)
    return out


def to_hf(spec: TensorSpec, w: np.ndarray) -> np.ndarray:
    """jaxmem layout (one layer's slice if stacked) -> HF layout, e.g. [D, N, H] -> [N*H, D]."""
    w = np.asarray(w)
    if tuple(w.shape) != spec.shape:
        raise ValueError(f"{'/'.join(spec.path)} has shape {tuple(w.shape)}, expected {spec.shape}")
    if spec.flat:
        return w.reshape(-1)
    if not spec.in_ndim:
        return w
    n_in = math.prod(spec.shape[:spec.in_ndim])
    return np.ascontiguousarray(w.reshape(n_in, -1).T)  # [out, in]


def from_hf(spec: TensorSpec, w: np.ndarray) -> np.ndarray:
    """HF layout -> jaxmem layout (one layer's slice if stacked); a wrong shape raises ValueError
    naming the HF tensor, its shape and the expected one."""
    if tuple(w.shape) != spec.hf_shape:
        raise ValueError(f"tensor {spec.hf_name} has shape {tuple(w.shape)}, "
                         f"expected {spec.hf_shape}")
    if spec.flat:
        return np.asarray(w).reshape(spec.shape)
    if not spec.in_ndim:
        return np.asarray(w)
    return w.T.reshape(spec.shape)  # [in, out] -> jaxmem's axes


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def hf_state_items(config: ModelConfig, params) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, HF-layout numpy array) for every tensor, in `hf_names` order; a fused tensor
    is its parts' concatenation.

    Takes one layer's slice of a stacked param at a time (np.asarray of a jax array copies only
    that slice to the host once the leaf is on the host), so an exporter can write as it goes.
    """
    tensors = by_tensor(config)
    for name in hf_names(config):
        members, i = tensors[name]
        parts = [to_hf(s, np.asarray(_get(params, s.path)[i] if s.stacked else _get(params, s.path)))
                 for s in members]
        yield name, join_parts(members, parts)


def join_parts(members: list[TensorSpec], parts: list[np.ndarray]) -> np.ndarray:
    """One HF tensor from its parts' HF-layout arrays (members in offset order)."""
    if members[0].part is None:
        return parts[0]
    return np.concatenate(parts, axis=members[0].part.axis)


def params_from_hf(config: ModelConfig, get_tensor: Callable[[str], np.ndarray],
                   dtype=np.float32) -> dict:
    """The jaxmem params tree (numpy, `dtype`) built from HF tensors fetched one at a time.

    get_tensor(name) returns one HF tensor (e.g. from safetensors' `safe_open`); each stacked
    param is allocated once as [L, ...] and filled layer by layer, so the host never holds a
    second copy of the model. A fused tensor is read once and cut into its params' parts. A
    tensor of the wrong shape raises ValueError naming it.
    """
    params: dict = {}
    L = config.num_layers
    for members in tensor_groups(tensor_specs(config)).values():
        outs = [np.empty((L, *s.shape) if s.stacked else s.shape, dtype) for s in members]
        for i in range(L) if members[0].stacked else [None]:
            name = members[0].name(i)
            w = get_tensor(name)
            if members[0].part is not None and tuple(w.shape) != members[0].tensor_shape:
                raise ValueError(f"tensor {name} has shape {tuple(w.shape)}, "
                                 f"expected {members[0].tensor_shape}")
            for s, out in zip(members, outs):
                one = from_hf(dataclasses.replace(s, hf_name=name), s.cut(w))
                if i is None:
                    out[...] = one
                else:
                    out[i] = one
        for s, out in zip(members, outs):
            node = params
            for key in s.path[:-1]:
                node = node.setdefault(key, {})
            node[s.path[-1]] = out
    return params
