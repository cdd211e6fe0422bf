"""The analytic memory model: bytes per component and dtype of one train step, on one device of a
mesh (one device is a mesh of one), without compiling.

Everything that is an argument of a program, or shaped like one (the state, the frozen base, the
batch, gradients, accumulator, compute copy, a gathered layer, the update's working set), is
counted leaf by leaf on the program's abstract values under the placement's shardings
(jaxmem.memory.counted: exact). The saved activations and the transients are the one formula
(jaxmem.memory.activations), evaluated at the local batch and sequence, and for `tensor` as the
block of a model with N/t heads, K/t kv heads and width F/t. The tests hold the formula to jax's
saved residuals (0.5%) and XLA's compiled peak; docs/memory.md.

The model of the peak (what is live when the backward starts):

    peak = state (params, optimizer state, loss scale, counters) + batch   [counted]
         + gradients (+ the accumulator when grad_accum > 1)
         + compute copy of the params (amp modes: saved by the loss for the backward)
         + activations saved for the backward under the remat policy (per layer x L, plus the
           few outside the layer stack)
         + the largest transient: the logits group (the loss's [B, T, V] fp32 buffers, or one
           chunk's with the fused loss) or one layer's backward (what it recomputes, the MLP
           backward's buffers, XLA attention's buffers of one query chunk; with LoRA also a
           quantized layer's dequantized weights and the adapters' gradient buffers), whichever
           is larger. Where the target compiles for a GPU (target.fuses_elementwise) three of
           these take the GPU compiler's form, read off its buffer reports (docs/memory.md).

or, if larger, what is live during the optimizer update (state, batch, gradients and the
optimizer's working set: RunOptimizer.working_set). Host-resident parts (`--offload-base host`)
are in no device phase; one layer's copy joins the backward (counted.layer_in_flight). Sizes in
bytes; axis letters as in docs/architecture.md; the whole model is in docs/memory.md.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxmem import target
from jaxmem.memory.activations import (FP32, _dname, _nbytes, attention_backward, attention_half,
                                       layer_residuals, mlp_backward, offloaded_residuals,
                                       outside_residuals)
from jaxmem.memory.counted import (Component, Kind, Phase, Where, abstract_state, compute_copy,
                                   count_state, gradient_part, head_gathered, layer_in_flight,
                                   local_bytes, params_fraction)
from jaxmem.memory.spec import StepSpec
from jaxmem.model.attention import on_xla
from jaxmem.model.remat import RematPolicy
from jaxmem.loss.chunked import resolve_loss_chunk, vocab_chunk
from jaxmem.parallel.mesh import AXES, MeshSpec
from jaxmem.families.params import num_params


def _mixed(items) -> str:
    """The one dtype of `items`, or their dtypes joined with '+'."""
    names = sorted({d for _, b, d in items if b and d not in ("mixed", "bool")})
    return "+".join(names) or "float32"


def _sum(items) -> int:
    return sum(b for _, b, _ in items)


def _rows(items) -> list[dict]:
    return [{"name": n, "bytes": int(b), "dtype": d} for n, b, d in items]


def local_spec(spec: StepSpec, mesh: MeshSpec) -> StepSpec:
    """The step as one device computes its activations: batch / (data x fsdp), T / context, and
    under `tensor` the block of a model with N/t heads, K/t kv heads and width F/t."""
    m, t = spec.model, mesh.tensor
    narrow = m if t == 1 else m.replace(num_heads=m.num_heads // t, head_dim=m.resolved_head_dim,
                                        num_kv_heads=m.num_kv_heads // t,
                                        intermediate_size=m.intermediate_size // t)
    return spec.replace(batch_size=spec.batch_size // mesh.batch_shards,
                               seq_len=spec.seq_len // mesh.context, model=narrow)


def _transients(spec: StepSpec, sizes: dict, loss_chunk: int, logits_group: int,
                layer_bwd: int, layer_dtype: str) -> tuple[list, list]:
    """(the backward's transients: the larger of the logits group and one layer's backward, and
    a frozen LM head gathered for the loss where that is larger still; the weights a layer's
    backward holds beyond the state: a gathered or copied-in layer)."""
    if logits_group >= layer_bwd:
        label = "fused loss: one chunk's logits group" if loss_chunk else "logits + dlogits [B,T,V]"
        transient = [Component(Kind.TRANSIENT, label, logits_group, "float32", Phase.BACKWARD)]
    else:
        transient = [Component(Kind.TRANSIENT, "one layer's backward", layer_bwd, layer_dtype,
                               Phase.BACKWARD)]
    in_flight = layer_in_flight(spec, sizes)
    head = head_gathered(spec, sizes)
    extra = logits_group + head - max(logits_group, layer_bwd) - sum(x.bytes for x in in_flight)
    if head and extra > 0:
        transient.append(Component(Kind.TRANSIENT, "frozen LM head gathered (fsdp)", extra,
                                   _dname(spec.precision.compute_dtype), Phase.BACKWARD))
    return transient, in_flight


def _gradients(spec: StepSpec, part: int, copy: int) -> tuple[int, str]:
    """(bytes, dtype) of the gradients the step holds: `part` in the params' dtype; where a
    compute copy is cast (`copy`) and a GPU's compiler builds the step, the cast params'
    gradients in the compute dtype: it fuses their cast to the params' dtype into the update
    (the 1B amp-bf16 step, remat full, 1x2048, H100 compiler, holds the bf16 weight copies in
    its 5.14 GiB temp but no fp32 gradient tree: XLA's buffer report); XLA:CPU holds the fp32
    one."""
    pd = jnp.dtype(spec.precision.param_dtype)
    if not (copy and target.fuses_elementwise()):
        return part, pd.name
    cd = jnp.dtype(spec.precision.compute_dtype)
    return part - copy // cd.itemsize * pd.itemsize + copy, f"{cd.name}+{pd.name}"


def analytic_breakdown(spec: StepSpec, mesh: MeshSpec | None = None) -> dict:
    """Bytes per component (with dtype) and the modelled peak on one device of `mesh` (None:
    one device); see the module docstring."""
    mesh = mesh or MeshSpec(1, 1, 1)
    sizes = {a: n for a, n in zip(AXES, mesh.sizes) if n > 1}
    local = local_spec(spec, mesh)
    c, p = local.model, local.precision
    B, T = local.rows, local.seq_len  # sequences: a preference pair is two
    attention = local.attention_path
    per_layer = _saved_per_layer(local, attention)
    loss_chunk = resolve_loss_chunk(local.loss_chunk, B, T, c)
    outside = outside_residuals(c, B, T, p.compute_dtype, local.remat, attention, loss_chunk)
    saved = c.num_layers * _sum(per_layer) + _sum(outside)
    logits_group = _logits_group(c, B, T, loss_chunk, p.compute_dtype)
    layer_bwd = _layer_backward(local, attention, per_layer)
    transient, in_flight = _transients(spec, sizes, loss_chunk, logits_group, layer_bwd,
                                       _mixed(per_layer + outside))
    part = gradient_part(spec, sizes)
    trained = count_state(spec, sizes)
    trained_bytes = sum(x.bytes for x in trained if x.kind is Kind.PARAMS)
    copy = compute_copy(spec, sizes, spec.in_backward)
    grads, grad_dtype = _gradients(spec, part, copy)
    comps = trained + [
        Component(Kind.COMPUTE_COPY, "params (compute copy)", copy, _dname(p.compute_dtype),
                  Phase.BACKWARD),
        Component(Kind.GRADIENTS, "gradients" if not spec.in_backward else "gradients (one part)",
                  grads, grad_dtype),
        Component(Kind.ACCUMULATOR, "grad accumulator",
                  trained_bytes if spec.grad_accum > 1 else 0,
                  jnp.dtype(spec.precision.param_dtype).name, Phase.BACKWARD),
        Component(Kind.ACTIVATIONS, "saved activations", saved, _mixed(per_layer + outside),
                  Phase.BACKWARD),
        offloaded_activations(local),
        *transient, *in_flight,
        _update(spec, sizes, part, trained_bytes)]
    in_phase = {ph: sum(x.bytes for x in comps if x.live_in(ph))
                for ph in (Phase.BACKWARD, Phase.OPTIMIZER)}
    peak = max(in_phase, key=lambda ph: (in_phase[ph], ph is Phase.BACKWARD))
    return {
        "params": num_params(spec.model), "attention": attention,
        "mesh": str(mesh), "devices": math.prod(mesh.sizes), "local_batch": B,
        "param_fraction": params_fraction(spec, sizes),
        "components": [x.row(peak) for x in comps],
        "saved_activations": {"per_layer": _rows(per_layer), "per_layer_bytes": _sum(per_layer),
                              "outside_layers": _rows(outside), "total_bytes": saved,
                              # the unfused loss keeps exp(logits - max) [B, T, V] fp32
                              "logits_bytes": 0 if loss_chunk else B * T * c.vocab_size * FP32},
        "transients": {"logits_group_bytes": logits_group, "layer_backward_bytes": layer_bwd,
                       "loss_chunk": loss_chunk},
        "peak_phase": peak.value,
        "total_bytes": int(in_phase[peak]),
        "host_bytes": int(sum(x.bytes for x in comps if x.where is Where.HOST)),
    }


def offloaded_activations(spec: StepSpec) -> Component:
    """What a `--remat offload...` policy keeps in pinned host memory over all the layers, at the
    spec's batch and sequence (a mesh's local ones: `local_spec`)."""
    c, cd = spec.model, spec.precision.compute_dtype
    return Component(Kind.ACTIVATIONS, "saved activations offloaded (host)", c.num_layers
                     * offloaded_residuals(c, spec.rows, spec.seq_len, cd, spec.remat),
                     _dname(cd), Phase.BACKWARD, Where.HOST)


def _update(spec: StepSpec, sizes: dict, part: int, trained_bytes: int) -> Component:
    """What the optimizer's update holds beyond state and gradients (the step's own optimizer
    says: jaxmem.train.optim.RunOptimizer.working_set); in-backward: one part's."""
    params = abstract_state(spec).params
    opt = spec.step.optimizer
    work = opt.working_set(params, lambda tree: local_bytes(tree, sizes))
    if spec.in_backward and trained_bytes:
        work = work * part // trained_bytes
    label = ("optimizer update in place: small leaves + one piece" if opt.in_place is not None
             else "optimizer update buffer")
    return Component(Kind.UPDATE, label, work, "float32", Phase.OPTIMIZER)


def _saved_per_layer(spec: StepSpec, attention: str) -> list:
    """What one block keeps for its backward, with LoRA's inputs where the policy saves them."""
    c, cd = spec.model, spec.precision.compute_dtype
    B, T = spec.rows, spec.seq_len
    return (layer_residuals(c, B, T, cd, spec.remat, attention)
            + spec.trainable.activations(c, B, T, cd, spec.remat)[0])


def _logits_group(c, B: int, T: int, loss_chunk: int | None, compute_dtype) -> int:
    """Logits and dlogits [B, T, V] fp32 (exp(..) is saved); fused (jaxmem.loss.chunked): one
    chunk's [B, Tc, V] or one vocabulary slice's [B, T, Vc], three fp32 buffers on XLA:CPU; a
    GPU's compiler fuses them into one and holds the head's slice [Vc, D] in the compute dtype
    (the 1B QLoRA step's buffer report, H100 compiler: f32[523,128256], bf16[32064,2048])."""
    V = c.vocab_size
    if not loss_chunk:
        return 2 * B * T * V * FP32
    vc = vocab_chunk(V, B * T) or V
    group = max(B * loss_chunk * V, B * T * vc if vc < V else 0) * FP32
    if not target.fuses_elementwise():
        return 3 * group
    return group + (vc * c.hidden_size * _nbytes(compute_dtype) if vc < V else 0)


def _layer_backward(spec: StepSpec, attention: str, per_layer: list) -> int:
    """One block's backward: what it recomputes, the MLP backward's working set, XLA attention's
    buffers of a query chunk; LoRA: dequantized weights, the adapters' gradients. On XLA:CPU all
    of it is live together; a GPU's compiler frees the MLP's activations before attention's
    backward starts (its buffer report), so there the larger of the two halves counts."""
    c, p = spec.model, spec.precision
    B, T, cd = spec.rows, spec.seq_len, p.compute_dtype
    full_layer = _sum(layer_residuals(c, B, T, cd, RematPolicy("none"), attention))
    recomputed = full_layer - _sum(per_layer)
    probs = attention_backward(c, B, T, cd) if on_xla(attention) else 0
    mlp = recomputed + mlp_backward(spec)
    if target.fuses_elementwise():
        layer_bwd = max(mlp, probs + min(recomputed, attention_half(c, B, T, cd)))
    else:
        layer_bwd = mlp + probs
    return layer_bwd + spec.trainable.activations(c, B, T, cd, spec.remat)[1]


def rule_of_thumb(num_params: int) -> dict[str, int]:
    """The bytes-per-parameter numbers commonly quoted, for the same model."""
    return {"fp32 weights (4 B/param)": 4 * num_params,
            "fp16/bf16 weights (2 B/param)": 2 * num_params,
            "int8 weights (1 B/param)": num_params,
            "mixed-precision Adam (16 B/param)": 16 * num_params,
            "6x fp32 weights (24 B/param)": 24 * num_params}
