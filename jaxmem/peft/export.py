"""A LoRA run's adapters as Hugging Face PEFT files, and its weights merged into the base.

    export_adapters(run, out)   adapter_config.json + adapter_model.safetensors (PEFT's layout)
    merged_params(run)          W + alpha/r A B per target, in the run's original base weights

`python -m jaxmem.export --adapters-only` writes the first; without it, a LoRA run's full export
is the merge. The merge uses the original base (the --init-from checkpoint's weights, read
exactly as stored, or the seed's init), never the dequantized int8 / NF4 copy the run trained
on: merging into those would bake the 4-bit rounding into every weight (a frequent complaint of
peft users merging into bitsandbytes layers). The base is re-read and its sha256 compared with
the one the run recorded, so adapters are never merged into another model.

PEFT layout: tensor `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r], with <module> the HF module name (`model.layers.3.self_attn.q_proj`) and in / out the
flattening of jaxmem's [in axes..., out axes...] that jaxmem.io.hf_names uses for the weights.
A module whose weight is fused from several projections (Phi-3's qkv_proj) gets one adapter
that is theirs exactly (`adapter_tensors`). jaxmem reads no PEFT adapters (no import path).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxmem.families.names import PROJECTIONS as TARGETS, tensor_groups
from jaxmem.families.config import ModelConfig
from jaxmem.io.hf_names import tensor_specs
from jaxmem.lora import adapter_subscripts
from jaxmem.peft.base import base_on_host, base_sha256, check_base, weight_axes


def _spec(run):
    """The run's LoraSpec (its Trainable; only a LoRA run reaches these functions)."""
    return run.step_config.trainable


def run_base(run) -> tuple[str, dict]:
    """(source, host params) of the run's base, checked against the sha256 it recorded."""
    source, host = base_on_host(run.model_config, run.config.data.seed, run.config.init.init_from)
    check_base(run.record, source, base_sha256(host))
    return source, host


def merged_params(run, verbose: bool = True):
    """The run's adapters merged into its original base weights (numpy, fp32 math)."""
    spec = _spec(run)
    source, host = run_base(run)
    if verbose:
        print(f"merging LoRA r={spec.rank} (alpha {spec.alpha:g}) into the original base weights "
              f"of {source} (sha256 {run.record['peft_base']['sha256'][:16]}...), not the "
              f"{spec.quantize} copy the run trained on" if spec.quantize != "none" else
              f"merging LoRA r={spec.rank} (alpha {spec.alpha:g}) into the base weights of "
              f"{source}")
    return merge(host, gathered_adapters(run.state.params), spec, run.model_config)


def _process_index() -> int:
    import jax  # noqa: PLC0415

    return jax.process_index()


def gathered_adapters(adapters):
    """The adapters tree as host numpy arrays, whole on every process: a leaf sharded over
    several processes (a mesh run) is all-gathered first (adapters are small: 2 r (in + out)
    values per target and layer)."""
    import jax  # noqa: PLC0415

    def host(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return jax.tree.map(host, adapters)


def _fused_targets(spec, c: ModelConfig) -> list[tuple[list, list]]:
    """(the specs stored in one HF module's weight, those of them LoRA targets) for every
    module with a target: one projection, or a fused tensor's parts (TensorSpec.part)."""
    targeted = {TARGETS[t] for t in spec.targets}
    out = []
    for members in tensor_groups(tensor_specs(c)).values():
        hit = [s for s in members if s.stacked and tuple(s.path[1:]) in targeted]
        if hit and any(s.part is not None and s.part.axis != 0 for s in hit):
            raise ValueError(f"{members[0].module()}: LoRA on a tensor fused along its input "
                             f"axis has no PEFT adapter")  # no family has one
        if hit:
            out.append((members, hit))
    return out


def adapter_tensors(adapters, spec, c: ModelConfig) -> dict[str, np.ndarray]:
    """{PEFT tensor name: array} for the adapters tree (fp32 numpy), one adapter per HF module.

    A fused module (Phi-3's qkv_proj: q, k, v rows) gets one adapter of rank r x (its targets):
    lora_A the targets' A stacked [n r, In], lora_B block-diagonal [Out, n r] (each target's B
    at its rows, zeros elsewhere), so B A is each target's B A at its rows, exactly; its
    alpha is n alpha (adapter_config's rank_pattern / alpha_pattern) so alpha / r is kept."""
    out = {}
    R = spec.rank
    for members, hit in _fused_targets(spec, c):
        for i in range(c.num_layers):
            As, Bs = [], []
            for s in hit:
                ad = adapters["layers"][s.path[1]][s.path[2]]
                a = np.asarray(ad["lora_a"][i], np.float32)  # [in..., R]
                b = np.asarray(ad["lora_b"][i], np.float32)  # [R, out...]
                As.append(a.reshape(-1, R).T)  # [R, In]
                Bs.append(b.reshape(R, -1).T)  # [Out_s, R]
            if members[0].part is None:
                A, B = As[0], Bs[0]
            else:
                A = np.concatenate(As, axis=0)  # [n R, In]
                B = np.zeros((members[0].part.total, R * len(hit)), np.float32)
                for j, (s, b) in enumerate(zip(hit, Bs)):
                    B[s.part.offset:s.part.offset + s.part.size, j * R:(j + 1) * R] = b
            module = f"base_model.model.{members[0].module(i)}"
            out[f"{module}.lora_A.weight"] = np.ascontiguousarray(A)
            out[f"{module}.lora_B.weight"] = np.ascontiguousarray(B)
    return out


def adapter_config(spec, base_path: str, c: ModelConfig) -> dict:
    """adapter_config.json for peft's LoraConfig; a fused module's rank and alpha (n targets
    in it: n r, n alpha) in rank_pattern / alpha_pattern."""
    modules, ranks, alphas = set(), {}, {}
    for members, hit in _fused_targets(spec, c):
        name = members[0].module().rsplit(".", 1)[-1]
        modules.add(name)
        if len(hit) > 1:
            ranks[name], alphas[name] = spec.rank * len(hit), spec.alpha * len(hit)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": sorted(modules), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
            "init_lora_weights": True, "modules_to_save": None,
            "rank_pattern": ranks, "alpha_pattern": alphas}


def export_adapters(run, out: Path, args=None) -> list[Path]:
    """Write the run's adapters in PEFT's layout into `out` (created; must not hold adapters)."""
    from safetensors.numpy import save_file

    spec = _spec(run)
    out = Path(out)
    if (out / "adapter_model.safetensors").exists():
        raise ValueError(f"--out {out} already holds adapter_model.safetensors (nothing written)")
    out.mkdir(parents=True, exist_ok=True)
    base = run.record.get("peft_base", {}).get("source", "")
    tensors = adapter_tensors(gathered_adapters(run.state.params), spec,
                              run.model_config)  # every process gathers
    if _process_index() != 0:  # process 0 writes (the same files from every process would race)
        return []
    files = [out / "adapter_model.safetensors", out / "adapter_config.json"]
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    files[1].write_text(json.dumps(adapter_config(spec, base, run.model_config), indent=2))
    return files


def lora_params(run):
    """The params a LoRA run computes with: its adapters on its base, quantized as in training
    (for sampling: `python -m jaxmem.generate --run`)."""
    from jaxmem.peft.base import base_on_device

    spec = _spec(run)
    _, host = run_base(run)
    frozen = base_on_device(host, spec, run.step_config.precision.compute_dtype)
    return spec.full_params(frozen, run.state.params)


def merge(base, adapters, spec, c: ModelConfig):
    """W + alpha/r * A B for each target, computed and returned in fp32 (the exporter's --dtype
    rounds it once, instead of a bf16 W rounding it here and again there).

    `base` must be the original (16- or 32-bit) weights, not the dequantized ones: merging into
    the dequantized weights would bake the 4-bit rounding error into every merged weight.
    Works on numpy or jax arrays; returns numpy arrays for the merged projections.
    """
    axes = weight_axes(c)
    layers = {g: dict(v) for g, v in base["layers"].items()}
    for name in spec.targets:
        group, pname = TARGETS[name]
        w = layers[group][pname]
        if not hasattr(w, "dtype") or not hasattr(w, "shape"):
            raise TypeError(f"merge needs the original dense weights; {group}/{pname} is a "
                            f"{type(w).__name__}")
        ad = adapters["layers"][group][pname]
        _, _, product = adapter_subscripts(axes[name][0])
        delta = np.einsum("L" + product.replace(",", ",L").replace("->", "->L"),
                          np.asarray(ad["lora_a"], np.float32), np.asarray(ad["lora_b"], np.float32))
        layers[group][pname] = np.asarray(w, np.float32) + spec.scale * delta
    return {**base, "layers": layers}
