"""Weights both ways between jaxmem params and a Hugging Face `LlamaForCausalLM` state_dict.

jaxmem stacks the layers (leading axis L) and keeps the head axes of attention separate; torch
`nn.Linear` stores [out, in]. Per tensor (l is the layer index):

    jaxmem                                   shape          torch (HF name)                       shape
    embed_tokens                             [V, D]         model.embed_tokens.weight             [V, D]
    layers/self_attn/q_proj                  [L, D, N, H]   model.layers.l.self_attn.q_proj.weight [N*H, D]
    layers/self_attn/{k,v}_proj              [L, D, K, H]   model.layers.l.self_attn.{k,v}_proj.weight [K*H, D]
    layers/self_attn/o_proj                  [L, N, H, D]   model.layers.l.self_attn.o_proj.weight [D, N*H]
    layers/mlp/{gate,up}_proj                [L, D, F]      model.layers.l.mlp.{gate,up}_proj.weight [F, D]
    layers/mlp/down_proj                     [L, F, D]      model.layers.l.mlp.down_proj.weight   [D, F]
    layers/{input,post_attention}_layernorm/scale [L, D]    model.layers.l.{...}_layernorm.weight [D]
    norm/scale                               [D]            model.norm.weight                     [D]
    lm_head (untied only)                    [D, V]         lm_head.weight                        [V, D]

Both models use RoPE's rotate_half layout (as HF checkpoints do), so q/k need no permutation; the
parity test in tests/test_torch_parity.py is what shows it. Every conversion is a reshape and a
transpose, so a round trip is bitwise exact in any dtype (bf16 included).

`torch_state_dict_to_jax` also accepts HF checkpoints: it ignores the legacy
`rotary_emb.inv_freq` buffers and, for tied embeddings, an `lm_head.weight` equal to the
embedding; any other missing or unexpected key raises KeyError naming it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from jaxmem.families.config import ModelConfig

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def to_torch(x) -> torch.Tensor:
    """A numpy/jax array as a contiguous torch tensor of the same dtype (bf16 included)."""
    a = np.asarray(x)
    if a.dtype == ml_dtypes.bfloat16:  # numpy has no bf16: move the bits
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as a numpy array of the same dtype (bf16 as ml_dtypes.bfloat16)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return t.numpy().copy()


def jax_to_torch_state_dict(params, config: ModelConfig) -> dict[str, torch.Tensor]:
    """jaxmem params (as from jaxmem.model.init_params) -> HF-named torch state_dict."""
    c = config
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim
    layers = params["layers"]
    attn, mlp = layers["self_attn"], layers["mlp"]
    sd = {"model.embed_tokens.weight": to_torch(params["embed_tokens"])}
    heads = {"q_proj": N, "k_proj": K, "v_proj": K}
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        for name, n in heads.items():  # [D, n, H] -> [n*H, D]
            w = np.asarray(attn[name][i]).reshape(D, n * H).T
            sd[pre + f"self_attn.{name}.weight"] = to_torch(w)
        sd[pre + "self_attn.o_proj.weight"] = to_torch(  # [N, H, D] -> [D, N*H]
            np.asarray(attn["o_proj"][i]).reshape(N * H, D).T)
        for name in _MLP:  # [in, out] -> [out, in]
            sd[pre + f"mlp.{name}.weight"] = to_torch(np.asarray(mlp[name][i]).T)
        for name in _NORMS:
            sd[pre + f"{name}.weight"] = to_torch(layers[name]["scale"][i])
    sd["model.norm.weight"] = to_torch(params["norm"]["scale"])
    if not c.tie_embeddings:
        sd["lm_head.weight"] = to_torch(np.asarray(params["lm_head"]).T)  # [D, V] -> [V, D]
    return sd


def expected_keys(config: ModelConfig) -> list[str]:
    """The state_dict keys of a jaxmem-shaped HF LlamaForCausalLM, in module order."""
    keys = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        keys += [pre + f"self_attn.{n}.weight" for n in _ATTN]
        keys += [pre + f"mlp.{n}.weight" for n in _MLP]
        keys += [pre + f"{n}.weight" for n in _NORMS]
    keys.append("model.norm.weight")
    if not config.tie_embeddings:
        keys.append("lm_head.weight")
    return keys


def torch_state_dict_to_jax(state_dict, config: ModelConfig):
    """HF-named torch state_dict (or gradients keyed the same way) -> jaxmem params.

    Returns numpy arrays in the tree structure of jaxmem.model.init_params, each with the dtype
    of its torch tensor (bf16 as ml_dtypes.bfloat16).
    """
    c = config
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim
    sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    want = expected_keys(c)
    if c.tie_embeddings and "lm_head.weight" in sd:
        if not torch.equal(sd["lm_head.weight"], sd.get("model.embed_tokens.weight")):
            raise ValueError("tie_embeddings=True but lm_head.weight differs from the embedding")
        sd.pop("lm_head.weight")
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or unexpected:
        raise KeyError(f"state_dict does not match the config: missing {missing[:8]}"
                       f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                       f"{'...' if len(unexpected) > 8 else ''}")

    def get(key, shape):
        a = to_numpy(sd[key])
        if a.shape != shape:
            raise ValueError(f"{key}: expected shape {shape}, got {a.shape}")
        return a

    def stack(fn):
        return np.stack([fn(f"model.layers.{i}.") for i in range(c.num_layers)])

    heads = {"q_proj": N, "k_proj": K, "v_proj": K}
    attn = {name: stack(lambda p, name=name, n=n: get(p + f"self_attn.{name}.weight", (n * H, D))
                        .T.reshape(D, n, H))
            for name, n in heads.items()}
    attn["o_proj"] = stack(lambda p: get(p + "self_attn.o_proj.weight", (D, N * H)).T
                           .reshape(N, H, D))
    Fw = c.intermediate_size
    mlp = {"gate_proj": stack(lambda p: get(p + "mlp.gate_proj.weight", (Fw, D)).T),
           "up_proj": stack(lambda p: get(p + "mlp.up_proj.weight", (Fw, D)).T),
           "down_proj": stack(lambda p: get(p + "mlp.down_proj.weight", (D, Fw)).T)}
    layers = {name: {"scale": stack(lambda p, name=name: get(p + f"{name}.weight", (D,)))}
              for name in _NORMS}
    layers.update(self_attn=attn, mlp=mlp)
    params = {"embed_tokens": get("model.embed_tokens.weight", (c.vocab_size, D)),
              "layers": layers,
              "norm": {"scale": get("model.norm.weight", (D,))}}
    if not c.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(get("lm_head.weight", (c.vocab_size, D)).T)
    return _contiguous(params)


def _contiguous(tree):
    if isinstance(tree, dict):
        return {k: _contiguous(v) for k, v in tree.items()}
    return np.ascontiguousarray(tree)


def grads_to_jax(model: torch.nn.Module, config: ModelConfig):
    """The `.grad` of every parameter of a torch LlamaForCausalLM, in jaxmem layout."""
    grads = {name: p.grad for name, p in model.named_parameters()}
    none = [n for n, g in grads.items() if g is None]
    if none:
        raise ValueError(f"no gradient for {none}")
    return torch_state_dict_to_jax(grads, config)
