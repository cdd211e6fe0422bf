"""The shared decoder's parameter names: its projections and the Hugging Face tensor table.

    PROJECTIONS                 --lora-targets short name -> (group in a block, parameter name)
    EMBEDDING, HEAD, FINAL_NORM, LAYERS    the top-level parameters' names
    input_ndim(name)            how many leading axes of a projection's weight are its inputs
    TensorSpec                  one parameter: its jaxmem path, HF name and how layouts relate
    Part                        where a parameter sits in a fused HF tensor (axis, offset, size)
    fuse(specs, paths, name)    a table with some params read as consecutive parts of one tensor
    decoder_tensors(config)     the decoder's table: one TensorSpec per jaxmem param path

Every registered family's checkpoints name these tensors alike (model.layers.{i}.self_attn.q_proj
...), so a family's `tensors` is this table unless it says otherwise (jaxmem.families.base);
jaxmem.io.hf_names converts the layouts, jaxmem.model.roles gives each name its role.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from jaxmem.families.config import ModelConfig

PROJECTIONS = {
    "q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"), "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}

EMBEDDING, HEAD, FINAL_NORM, LAYERS = "embed_tokens", "lm_head", "norm", "layers"


def input_ndim(name: str) -> int:
    """Leading input axes of projection `name`'s weight: o_proj's [N, H, D] has two, the others
    ([D, N, H], [D, F], [F, D], the head's [D, V]) one."""
    return 2 if name == "o_proj" else 1


@dataclass(frozen=True)
class Part:
    """A parameter stored as a slice of a bigger (fused) HF tensor: HF layout's axis `axis`,
    rows offset..offset+size of `total` (Phi-3's qkv_proj.weight holds q's rows, then k's,
    then v's: three parts of axis 0)."""

    axis: int
    offset: int
    size: int
    total: int


@dataclass(frozen=True)
class TensorSpec:
    """One parameter: its jaxmem path, its HF name and how the layouts relate.

    path: keys into the jaxmem params tree, e.g. ("layers", "self_attn", "q_proj").
    hf_name: the HF tensor name; for stacked params a template with `{i}` for the layer index.
    shape: jaxmem's shape of one tensor (per layer, without L, for stacked params).
    stacked: the jaxmem param has a leading layer axis L (one HF tensor per layer).
    in_ndim: for a projection, how many leading axes of `shape` are input axes (HF stores the
        transpose of the [in, out] flattening); 0 for tensors stored identically (norms, embed).
    """

    path: tuple[str, ...]
    hf_name: str
    shape: tuple[int, ...]
    stacked: bool
    in_ndim: int = 0
    flat: bool = False  # HF stores it flattened to one axis (a bias [N, H] as [N*H])
    # a slice of a fused HF tensor (several params share `hf_name`), None: the whole tensor
    part: Part | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """This parameter's shape in HF's layout: [out, in] for a projection, one axis for a flat
        one (a bias), else jaxmem's. For a part, the part's (`tensor_shape` is the whole's)."""
        if self.flat:
            return (math.prod(self.shape),)
        if not self.in_ndim:
            return self.shape
        return (math.prod(self.shape[self.in_ndim:]), math.prod(self.shape[:self.in_ndim]))

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """The HF tensor's shape: `hf_shape`, or for a part the fused tensor's."""
        shape = self.hf_shape
        if self.part is None:
            return shape
        return shape[:self.part.axis] + (self.part.total,) + shape[self.part.axis + 1:]

    def tensor_index(self, index: tuple) -> tuple:
        """An index (slices, one per HF axis) of this parameter -> the same elements' index in
        the HF tensor (a part's axis shifted by its offset)."""
        if self.part is None:
            return tuple(index)
        index = list(index) + [slice(None)] * (len(self.hf_shape) - len(index))
        a, off = self.part.axis, self.part.offset
        start, stop, step = index[a].indices(self.part.size)
        index[a] = slice(start + off, stop + off, step)
        return tuple(index)

    def cut(self, tensor):
        """This parameter's slice of the HF tensor (the tensor itself when not a part)."""
        if self.part is None:
            return tensor
        return tensor[self.tensor_index(tuple(slice(None) for _ in self.hf_shape))]

    def name(self, layer: int | None = None) -> str:
        """The HF tensor name (for layer `layer` when stacked)."""
        return self.hf_name.format(i=layer) if self.stacked else self.hf_name

    def module(self, layer: int | None = None) -> str:
        """The HF module name (the tensor name without `.weight`), as PEFT names adapters."""
        return self.name(layer).removesuffix(".weight")


def fuse(specs: list[TensorSpec], paths: list[tuple[str, ...]], hf_name: str,
         axis: int = 0) -> list[TensorSpec]:
    """`specs` with the params at `paths` read as consecutive parts (in `paths` order) of one HF
    tensor `hf_name` along HF axis `axis`, placed where the first of them was."""
    members = [next(s for s in specs if s.path == tuple(p)) for p in paths]
    total = sum(m.hf_shape[axis] for m in members)
    fused, offset = [], 0
    for m in members:
        size = m.hf_shape[axis]
        fused.append(replace(m, hf_name=hf_name, part=Part(axis, offset, size, total)))
        offset += size
    first = specs.index(members[0])
    rest = [s for s in specs if s not in members]
    return rest[:first] + fused + rest[first:]


def tensor_groups(specs: list[TensorSpec]) -> dict[str, list[TensorSpec]]:
    """{HF name (a template for stacked ones): the specs stored in it}, in table order: one
    spec per tensor, or a fused tensor's parts in offset order."""
    groups: dict[str, list[TensorSpec]] = {}
    for s in specs:
        groups.setdefault(s.hf_name, []).append(s)
    for name, members in groups.items():
        if len(members) > 1 and any(m.part is None for m in members):
            raise ValueError(f"HF tensor {name} is named by several params, not all parts")
        members.sort(key=lambda m: m.part.offset if m.part else 0)
    return groups


def decoder_tensors(config: ModelConfig) -> list[TensorSpec]:
    """Every jaxmem parameter of `config` with its HF counterpart, in HF's usual file order."""
    c = config
    D, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    N, K, H = c.num_heads, c.num_kv_heads, c.resolved_head_dim
    proj_shapes = {  # jaxmem shape per layer and number of input axes
        "q_proj": ((D, N, H), 1), "k_proj": ((D, K, H), 1), "v_proj": ((D, K, H), 1),
        "o_proj": ((N, H, D), 2), "gate_proj": ((D, F), 1), "up_proj": ((D, F), 1),
        "down_proj": ((F, D), 1),
    }
    specs = [TensorSpec(("embed_tokens",), "model.embed_tokens.weight", (V, D), False)]
    layer = "model.layers.{i}."
    for norm in c.norms.names:  # where the block's norms sit (jaxmem.families.norms)
        specs.append(TensorSpec(("layers", norm, "scale"), f"{layer}{norm}.weight", (D,), True))
    for parent, name in PROJECTIONS.values():
        shape, in_ndim = proj_shapes[name]
        specs.append(TensorSpec(("layers", parent, name), f"{layer}{parent}.{name}.weight",
                                shape, True, in_ndim))
    if c.qkv_bias:  # Qwen2: [N, H] / [K, H] here, [N*H] / [K*H] there
        for name, heads in (("q", N), ("k", K), ("v", K)):
            specs.append(TensorSpec(("layers", "self_attn", f"{name}_bias"),
                                    f"{layer}self_attn.{name}_proj.bias", (heads, H), True,
                                    flat=True))
    if c.qk_norm:  # RMSNorm scales on q and k: [H] (Qwen3), [N*H] and [K*H] (OLMo 2)
        for norm, width in zip(("q_norm", "k_norm"), c.qk_norm_widths):
            specs.append(TensorSpec(("layers", "self_attn", norm, "scale"),
                                    f"{layer}self_attn.{norm}.weight", (width,), True))
    specs.append(TensorSpec(("norm", "scale"), "model.norm.weight", (D,), False))
    if not c.tie_embeddings:
        specs.append(TensorSpec(("lm_head",), "lm_head.weight", (D, V), False, in_ndim=1))
    return specs
