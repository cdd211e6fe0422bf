"""The analytic memory model: bytes per component and dtype of one train step, from shapes alone.

    analytic_breakdown(spec)   bytes per component and dtype, and the modelled peak
    layer_residuals(...)       what one decoder block keeps for its backward, per remat policy
    outside_residuals(...)     what is kept outside the layer stack (RoPE, final norm, loss)
    rule_of_thumb(params)      the bytes-per-parameter numbers people quote

A formula, not a measurement: it says *why* the compiled peak is what it is, and the tests hold
it to jax's saved residuals (0.5%) and XLA's compiled peak (15%); docs/memory.md.

The model of the peak (what is live when the backward starts):

    peak = state (params, optimizer state, loss scale, counters) + batch
         + gradients (+ the accumulator when grad_accum > 1)
         + compute copy of the params (amp modes: saved by the loss for the backward)
         + activations saved for the backward under the remat policy (per layer x L, plus the
           few outside the layer stack)
         + the largest transient: the logits group (logits, exp(logits - max), dlogits, all
           [B, T, V] fp32; with the fused loss, jaxmem.loss.chunked, those of one chunk) or
           one layer's backward (its recomputed activations plus, on the XLA attention path, the
           recomputed probabilities of one query chunk and their gradients; with LoRA also a
           quantized layer's dequantized weights and the adapters' [B, T, Out] gradient buffers,
           jaxmem.peft.memory), whichever is larger

or, if larger, what is live during the optimizer update: state + batch + gradients + one
params-sized update buffer (activations are freed by then; at full size with remat this phase
sets the peak: 5 x 4 B/param in fp32); adamw8bit updates in place (AdamW8bitInPlace): only
its small leaves and one piece of a large one (update_8bit_working_set).

With `--offload-base host` (LoRA) the frozen block layers are in host memory: counted as phase
"host" (`host_bytes`), in no device phase, and one layer's copy joins the backward phase
(jaxmem.memory.lora_mesh).

One layer's backward includes, where the policy recomputes the MLP, its backward's working set
(mlp_backward): the lean SwiGLU keeps fewer residuals than its backward allocates. Sizes are in
bytes. Axis letters follow docs/architecture.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem.config.model import ModelConfig
from jaxmem.memory.lora_mesh import base_components as offloaded_base
from jaxmem.memory.spec import StepSpec
from jaxmem.model.llama import abstract_params
from jaxmem.model.attention import query_chunk
from jaxmem.model.remat import RematPolicy
from jaxmem.loss.chunked import resolve_loss_chunk, vocab_chunk
from jaxmem.model.roles import count_by_role
from jaxmem.memory.activations import (FP32, _dname, _nbytes, layer_residuals, mlp_backward,
                                       outside_residuals)



def _state_dtype(spec: StepSpec):
    """Dtype of the optimizer's moments: the params' (bf16-sr: fp32, no master copy)."""
    return jnp.float32 if spec.precision.stochastic_rounding else spec.precision.param_dtype


def _mu_dtype(spec: StepSpec):
    return {None: _state_dtype(spec), "fp32": jnp.float32, "float32": jnp.float32,
            "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}[spec.mu_dtype]


def optimizer_state(spec: StepSpec, P: int) -> list[tuple[str, int, str]]:
    """(name, bytes, dtype) of the optimizer state: AdamW's mu and nu by formula; any other
    optimizer's leaves counted on its abstract state (jaxmem.memory.optimizer_bytes)."""
    sd = _state_dtype(spec)
    adam = [("adam mu", P * _nbytes(_mu_dtype(spec)), _dname(_mu_dtype(spec))),
            ("adam nu", P * _nbytes(sd), _dname(sd))]
    if spec.optimizer == "adamw":
        return adam
    from jaxmem.config.run import OptimConfig
    from jaxmem.memory.optimizer_bytes import optimizer_components
    optim = OptimConfig(optimizer=spec.optimizer, mu_dtype=spec.mu_dtype)
    return spec.trainable.optimizer_state(adam, lambda: list(
        optimizer_components(spec.model, optim, spec.precision)))


@functools.lru_cache(maxsize=64)
def norm_params(c: ModelConfig) -> int:
    """Parameters that are never cast to the compute dtype: those whose role is `norm`
    (jaxmem.model.roles), counted on the abstract params (jax.eval_shape, nothing allocated)."""
    return count_by_role(abstract_params(c)).get("norm", 0)


# fp32 bytes per element the 8-bit update holds while it works on a leaf or a piece: the
# gradient, the dequantized moments, the update and the new weight (jaxmem.optim.AdamW8bitInPlace),
# fitted on CPU compiles (docs/memory.md).
UPDATE_8BIT_BYTES = 20


def update_8bit_working_set(c: ModelConfig) -> int:
    """What adamw8bit's in-place update holds beyond the state and the gradients.

    AdamW8bitInPlace updates a leaf of more than optim.CHUNK elements in row pieces, in place on
    the donated state: one piece's working set at a time. A smaller leaf is updated whole and
    written back with a select (a skipped step keeps it), and XLA keeps the working sets of all
    of them live together. So: 20 B x (elements of the leaves updated whole + the largest piece),
    not the params-sized update buffer optax's update needs."""
    from jaxmem.optim import row_chunks
    whole, piece = 0, 0
    for leaf in jax.tree_util.tree_leaves(abstract_params(c)):
        n = row_chunks(leaf.shape)
        if n == 1:
            whole += leaf.size
        else:
            piece = max(piece, leaf.size // n)
    return UPDATE_8BIT_BYTES * (whole + piece)


def _mixed(items) -> str:
    """The one dtype of `items`, or their dtypes joined with '+'."""
    names = sorted({d for _, b, d in items if b and d not in ("mixed", "bool")})
    return "+".join(names) or "float32"


def _sum(items) -> int:
    return sum(b for _, b, _ in items)


def _rows(items) -> list[dict]:
    return [{"name": n, "bytes": int(b), "dtype": d} for n, b, d in items]


# --- the whole step ---------------------------------------------------------------------------

def analytic_breakdown(spec: StepSpec) -> dict:
    """Bytes per component (with dtype) and the modelled peak; see the module docstring."""
    c, p = spec.model, spec.precision
    B, T = spec.batch_size, spec.seq_len
    attention = spec.attention_path
    per_layer = _saved_per_layer(spec, attention)
    loss_chunk = resolve_loss_chunk(spec.loss_chunk, B, T, c)
    outside = outside_residuals(c, B, T, p.compute_dtype, spec.remat, attention, loss_chunk)
    saved = c.num_layers * _sum(per_layer) + _sum(outside)
    logits_group = _logits_group(c, B, T, loss_chunk)
    layer_bwd = _layer_backward(spec, attention, per_layer)
    trained = _trained_params(spec)
    if logits_group >= layer_bwd:
        head = "fused loss: one chunk's logits group" if loss_chunk else "logits + dlogits [B,T,V]"
        transient = (head, logits_group, "float32")
    else:
        transient = ("one layer's backward", layer_bwd, _mixed(per_layer + outside))
    comps = [(n, b, d, "both") for n, b, d in _persistent(spec, trained)] + _frozen_base(spec)
    grads = _gradient_parts(spec, trained)
    comps += _backward_phase(spec, trained, grads, (saved, _mixed(per_layer + outside)), transient)
    comps += [(*_update_buffer(spec, grads[0]), "optimizer")]
    in_phase = {ph: sum(b for _, b, _, q in comps if q == ph) for ph in ("backward", "optimizer")}
    peak_phase = "backward" if in_phase["backward"] >= in_phase["optimizer"] else "optimizer"
    components = [{"name": n, "bytes": int(b), "dtype": d, "phase": ph,
                   "in_peak": ph in ("both", peak_phase)} for n, b, d, ph in comps]
    return {
        "params": c.num_params(), "attention": attention, "components": components,
        "saved_activations": {"per_layer": _rows(per_layer), "per_layer_bytes": _sum(per_layer),
                              "outside_layers": _rows(outside), "total_bytes": saved},
        "transients": {"logits_group_bytes": logits_group, "layer_backward_bytes": layer_bwd,
                       "loss_chunk": loss_chunk},
        "peak_phase": peak_phase,
        "total_bytes": int(sum(x["bytes"] for x in components if x["in_peak"])),
        "host_bytes": int(sum(x["bytes"] for x in components if x["phase"] == "host")),
    }


def _trained_params(spec: StepSpec) -> int:
    """Parameters the optimizer updates: all, or a LoRA run's adapters (jaxmem.peft.memory)."""
    return spec.trainable.trained_params(spec.model)


def _saved_per_layer(spec: StepSpec, attention: str) -> list:
    """What one block keeps for its backward, with LoRA's inputs where the policy saves them."""
    c, cd = spec.model, spec.precision.compute_dtype
    B, T = spec.batch_size, spec.seq_len
    return (layer_residuals(c, B, T, cd, spec.remat, attention)
            + spec.trainable.saved_per_layer(c, B, T, cd, spec.remat))


def _logits_group(c: ModelConfig, B: int, T: int, loss_chunk: int | None) -> int:
    """Logits and dlogits [B, T, V] fp32 (exp(..) is saved); fused: one chunk's three."""
    V = c.vocab_size
    if not loss_chunk:
        return 2 * B * T * V * FP32
    vc = vocab_chunk(V, B * T) or V
    return 3 * max(B * loss_chunk * V, B * T * vc if vc < V else 0) * FP32


def _layer_backward(spec: StepSpec, attention: str, per_layer: list) -> int:
    """One block's backward: what it recomputes, XLA attention's probabilities of a query chunk,
    the MLP backward's working set; LoRA: dequantized weights, the adapters' gradients."""
    c, p = spec.model, spec.precision
    B, T, N = spec.batch_size, spec.seq_len, c.num_heads
    full_layer = _sum(layer_residuals(c, B, T, p.compute_dtype, RematPolicy("none"), attention))
    layer_bwd = full_layer - _sum(per_layer)
    if attention == "xla":  # the probabilities of one query chunk (jaxmem.model.attention)
        cb = _nbytes(p.compute_dtype)
        layer_bwd += B * N * query_chunk((B, T, N), T) * T * (3 * FP32 + cb)
    layer_bwd += mlp_backward(spec)
    return layer_bwd + spec.trainable.backward_transient(c, B, T, p.compute_dtype)


def _gradient_parts(spec: StepSpec, trained: int) -> tuple[int, int]:
    """(params whose gradients exist at once, bytes of their compute copy). amp: the backward
    keeps the compute copies of the matrices it multiplies by (not of an untied embedding, only
    gathered; of LoRA's adapters only, the base is stored in the compute dtype).
    --optimizer-in-backward (jaxmem.train.inbackward) holds one part at a time, the largest."""
    c, p = spec.model, spec.precision
    cb = _nbytes(p.compute_dtype)
    amp = jnp.dtype(p.param_dtype) != jnp.dtype(p.compute_dtype)
    P = c.num_params()
    untied_embed = 0 if c.tie_embeddings else c.vocab_size * c.hidden_size
    # LoRA: the adapters' copy; the base is stored cast
    castable = spec.trainable.compute_copy(P - norm_params(c) - untied_embed, trained)
    compute_copy = castable * cb if amp else 0
    if not spec.in_backward:
        return trained, compute_copy
    head_params = c.vocab_size * c.hidden_size
    stacked = P - head_params * (1 if c.tie_embeddings else 2) - c.hidden_size
    part = max(stacked // c.num_layers, head_params)
    return part, part * cb if amp else 0


def _backward_phase(spec: StepSpec, trained: int, grads: tuple[int, int], saved: tuple[int, str],
                    transient: tuple[str, int, str]) -> list[tuple[str, int, str, str]]:
    """Live when the backward starts: compute copy, gradients, accumulator, saved, transient."""
    pb, pd = _nbytes(spec.precision.param_dtype), _dname(spec.precision.param_dtype)
    part, compute_copy = grads
    return [("params (compute copy)", compute_copy, _dname(spec.precision.compute_dtype),
             "backward"),
            ("gradients" if part == trained else "gradients (one part)", part * pb, pd, "both"),
            ("grad accumulator", trained * pb if spec.grad_accum > 1 else 0, pd, "backward"),
            ("saved activations", *saved, "backward"),
            (*transient, "backward")]


def _update_buffer(spec: StepSpec, part: int) -> tuple[str, int, str]:
    """Beyond state and gradients: one update buffer for `part` params, or adamw8bit's in-place
    working set. bf16-sr: optax's updates are fp32; adamw8bit's in the gradients' dtype."""
    p = spec.precision
    buffer = ("optimizer update buffer", part * _nbytes(p.param_dtype), _dname(p.param_dtype))
    if spec.optimizer == "adamw8bit":  # the model's weights: updated in place
        return spec.trainable.adamw8bit_update(lambda: (
            "optimizer update in place: small leaves + one piece",
            update_8bit_working_set(spec.model), "float32"), buffer)
    return ("optimizer update buffer", part * FP32, "float32") if p.stochastic_rounding else buffer


def _persistent(spec: StepSpec, trained: int) -> list[tuple[str, int, str]]:
    """Held in every phase: master params, optimizer state, loss scale, batch."""
    p = spec.precision
    B, T, K = spec.batch_size, spec.seq_len, spec.grad_accum
    loss_scale = {"none": 0, "static": 4, "dynamic": 12}[p.loss_scale.partition(":")[0]]
    master = f"{spec.trainable.params_name} (master)"
    return [(master, trained * _nbytes(p.param_dtype), _dname(p.param_dtype)),
            *optimizer_state(spec, trained),
            ("loss scale", loss_scale, "float32"),
            ("batch (inputs, targets, mask)", 3 * K * B * T * 4, "int32")]


def _frozen_base(spec: StepSpec) -> list[tuple[str, int, str, str]]:
    """A LoRA run's frozen base; --offload-base host: its layers on the host, one on device."""
    if spec.offload_base == "host":  # (LoRA only: the config refuses it for a full run)
        return offloaded_base(spec, {})
    return [(n, b, d, "both") for n, b, d in
            spec.trainable.frozen_components(spec.model, spec.precision.compute_dtype)]


def rule_of_thumb(num_params: int) -> dict[str, int]:
    """The bytes-per-parameter numbers commonly quoted, for the same model."""
    return {"fp32 weights (4 B/param)": 4 * num_params,
            "fp16/bf16 weights (2 B/param)": 2 * num_params,
            "int8 weights (1 B/param)": num_params,
            "mixed-precision Adam (16 B/param)": 16 * num_params,
            "6x fp32 weights (24 B/param)": 24 * num_params}
