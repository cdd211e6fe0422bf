"""The whole run, not one step: what the device holds while each phase of a run executes.

    SampleShape.of(cfg)                   the end-of-run sample's size (RunConfig.sample)
    analytic_phases(spec, sample)         bytes of each phase from shapes alone
    run_phases(spec, sample, ...)         each phase with its analytic and (compile=True)
                                          compiled peak, and the largest: the run's peak

A run (jaxmem.train.loop) goes through these programs, one at a time, and the device must hold
the largest of them:

    import  LoRA / QLoRA: the frozen base put on the device, each quantized projection one
            layer at a time into its stacked result (jaxmem.peft.base.quantize_on_device):
            the base made so far (counted whole: an upper bound), one projection's stacked
            result, one layer's fp32 weight and the quantizer's temporaries. Shown for every
            LoRA run, from the preset's shapes: an `--init-from` checkpoint and a seed's init
            are imported alike (a 16-bit checkpoint's layer is half the fp32 one counted)
    state   making the train state (or restoring it): the program's output is the state
    step    the train step: the state and batch are its (donated) arguments
    eval    the eval function on one [B, T] batch (the fused LM-head loss, never [B, T, V]
            logits); the loop still holds the whole train state, so the optimizer state and
            counters are live outside the program
    sample  the end-of-run sample (jaxmem.decode.sampling) over [1, prompt + new tokens]:
            the params cast to the sampling dtype (jaxmem.decode.stopping.sample_dtype; a new
            copy unless the dtype is the params'), with the whole train state still live. A
            LoRA / QLoRA run samples with its frozen base as stored (int8 / NF4 projections,
            dequantized one layer at a time inside the sampler) and its adapters

Each phase's total is what its program needs (XLA's compiled peak: temp + arguments + output -
aliases) plus what the run holds outside it. The step is always compiled (jaxmem.memory.compiled);
the others with `compile=True` (`python -m jaxmem.memory --compile`), else their analytic
numbers stand in. Saving a checkpoint is left out: it runs on the host copy of the state
(another branch makes it asynchronous).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmem.memory.activations import FP32, layer_residuals, outside_residuals
from jaxmem.memory.analytic import analytic_breakdown, norm_params
from jaxmem.memory.compiled import (abstract_frozen, abstract_state, compile_eval,
                                    compile_import, compile_sample, compile_state, tree_bytes)
from jaxmem.memory.spec import StepSpec
from jaxmem.model.attention import query_chunk
from jaxmem.model.llama import abstract_params
from jaxmem.model.remat import RematPolicy
from jaxmem.loss.chunked import resolve_loss_chunk

PHASES = ("import", "state", "step", "eval", "sample")
# The end-of-run sample's prompt, in tokens: its default is the first line of the eval data cut
# to 60 characters (jaxmem.train.loop.eval_prompt), <= 61 tokens with BOS for any tokenizer.
PROMPT_TOKENS = 64


@dataclass(frozen=True)
class SampleShape:
    """The end-of-run sample: `max_new_tokens` after a prompt of `prompt_tokens` (0: no sample).

    total: positions of its token buffer, capped by the model's (jaxmem.decode.sampling).
    dtype: the run's sampling dtype flag (None: jaxmem.decode.stopping.sample_dtype's default).
    """

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 40
    prompt_tokens: int = PROMPT_TOKENS
    dtype: str | None = None

    @classmethod
    def of(cls, cfg) -> "SampleShape":
        """The sample of a RunConfig (its sample section)."""
        s = cfg.sample
        return cls(s.max_new_tokens, s.temperature, s.top_k, dtype=s.dtype)

    def compute_dtype(self, run_dtype):
        """The dtype the sampler computes and caches in for a run computing in `run_dtype`."""
        from jaxmem.decode.stopping import sample_dtype
        return sample_dtype(self.dtype, run_dtype)

    def total(self, limit: int) -> int:
        n = min(self.prompt_tokens, limit - 1)
        return n + min(self.max_new_tokens, limit - n)

    def n_prompt(self, limit: int) -> int:
        return min(self.prompt_tokens, limit - 1)


def _b(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _forward_working_set(spec: StepSpec, B: int, T: int, logits: str) -> int:
    """What a forward pass without a backward holds besides its arguments: the residual stream,
    one layer's activations (freed with the layer), the attention probabilities of one query
    chunk, and the head: the fused loss's one chunk of logits (eval) or all [B, T, V] logits
    (today's sampler)."""
    c, p = spec.model, spec.precision
    cb = _b(p.compute_dtype)
    D, V, N = c.hidden_size, c.vocab_size, c.num_heads
    layer = sum(b for _, b, _ in layer_residuals(c, B, T, p.compute_dtype, RematPolicy("none"),
                                                 "xla"))
    attn = B * N * query_chunk((B, T, N), T) * T * (FP32 + cb)  # probabilities fp32 + copy
    stream = 2 * B * T * D * cb + sum(b for n, b, _ in outside_residuals(
        c, B, T, p.compute_dtype, RematPolicy("full"), "xla", 0) if n.startswith("RoPE"))
    if logits == "fused":
        chunk = resolve_loss_chunk(spec.loss_chunk, B, T, c) or T
        head = 2 * B * chunk * V * FP32 + 2 * B * T * FP32  # logits, exp; logsumexp, weights
    else:
        head = 2 * B * T * V * FP32  # logits [B, T, V] fp32, and their max-shifted exp
    return stream + max(layer + attn, head)


def analytic_phases(spec: StepSpec, sample: SampleShape | None = None) -> dict:
    """{phase: {"total": bytes, "what": text}} from shapes: what the device holds in each.

    state: the state's bytes plus one params leaf in fp32 (made whole, then cast);
    step: jaxmem.memory.analytic's peak; eval: the state, the batch, the compute copy of the
    params (amp) and a forward's working set; sample: the state, the params in the compute dtype
    (a new copy where that is not their dtype) and the sampler's forward over [1, total].
    """
    a = analytic_breakdown(spec)
    c, p = spec.model, spec.precision
    comps = {x["name"]: x for x in a["components"]}
    state = sum(x["bytes"] for x in a["components"] if x["phase"] == "both"
                and not x["name"].startswith(("gradients", "batch")))
    leaf = max(int(x.size) for x in jax.tree_util.tree_leaves(abstract_params(c))) * FP32
    B, T = spec.batch_size, spec.seq_len
    copy = comps["params (compute copy)"]["bytes"]
    out = {
        "state": {"total": state + leaf,
                  "what": "making the train state: its bytes + one fp32 params leaf"},
        "step": {"total": a["total_bytes"],
                 "what": f"one train step ({a['peak_phase']} phase at the peak)"},
        "eval": {"total": state + 3 * B * T * 4 + copy
                 + _forward_working_set(spec, B, T, "fused"),
                 "what": f"evaluation, batch {B} x {T}, fused loss (with the whole state)"},
    }
    out = {**spec.trainable.import_phase(lambda: _analytic_import(spec)), **out}  # LoRA's base
    if sample is not None and sample.max_new_tokens > 0:
        limit = c.max_position_embeddings
        total = sample.total(limit)
        sd = sample.compute_dtype(p.compute_dtype)
        # LoRA: the adapters cast; the base as stored, a quantized layer dequantized at a time
        cast = spec.trainable.sample_cast(lambda: _model_sample_cast(spec, sd),
                                          lambda: _lora_sample_cast(spec, sd))
        out["sample"] = {"total": state + cast + _forward_working_set(spec, 1, total, "full"),
                         "what": f"end-of-run sample, 1 x {total} tokens "
                                               f"(with the whole state)"}
    return out


def _model_sample_cast(spec: StepSpec, sd) -> int:
    """The model's params cast to the sampler's dtype `sd` (norms in fp32), 0 if stored in it."""
    c, p = spec.model, spec.precision
    P, Pn = c.num_params(), norm_params(c)
    changed = jnp.dtype(p.param_dtype) != jnp.dtype(sd)
    return (P - Pn) * _b(sd) + Pn * FP32 if changed else 0


def _analytic_import(spec: StepSpec) -> dict:
    """The frozen base (as the step holds it) and, while a projection is quantized, its largest
    layer three times in fp32: the weight read, its fp32 blocks and their normalized values."""
    from jaxmem.peft import memory as peft_memory
    c, lora = spec.model, spec.trainable
    base = sum(b for _, b, _ in peft_memory.base_components(c, lora, spec.precision.compute_dtype))
    layer = max(i * o for i, o in peft_memory._in_out(c).values())
    work = 3 * layer * FP32 if lora.quantize != "none" else 0
    what = ("importing the frozen base: " + (f"{lora.quantize} quantized one layer at a time"
                                            if lora.quantize != "none" else "put as stored"))
    return {"total": base + work, "what": what}


def _lora_sample_cast(spec: StepSpec, dtype) -> int:
    """What a LoRA sampler makes of its params in `dtype`: the adapters cast, the base's 16-bit
    leaves (embedding, head, an unquantized base's projections) cast where `dtype` is not the
    compute dtype they are stored in, and one quantized layer's projections dequantized."""
    from jaxmem.peft import memory as peft_memory
    c, lora, p = spec.model, spec.trainable, spec.precision
    out = peft_memory.trainable_params(c, lora) * _b(dtype)
    if jnp.dtype(dtype) != jnp.dtype(p.compute_dtype):
        out += sum(b // _b(p.compute_dtype) * _b(dtype)
                   for n, b, d in peft_memory.base_components(c, lora, p.compute_dtype)
                   if d == jnp.dtype(p.compute_dtype).name)
    return out + peft_memory.dequant_transient(c, lora, dtype) // c.num_layers


def _held_outside(spec: StepSpec) -> dict:
    """Bytes the run holds outside each phase's program (the train state's parts that are not
    the program's arguments; LoRA's frozen base where it is not one)."""
    state = abstract_state(spec)
    state_bytes, param_bytes = tree_bytes(state), tree_bytes(state.params)
    frozen = tree_bytes(abstract_frozen(spec))  # 0 when nothing is frozen
    if spec.offload_base == "host":  # LoRA's block layers in host memory
        from jaxmem.memory.lora_mesh import base_split
        frozen -= base_split(spec, {}).layers
    # the sampler takes the params as stored and casts them inside its program (a temporary):
    # its arguments are the state's own params (LoRA: the frozen base and the adapters)
    return {"import": frozen, "state": frozen, "step": 0, "eval": state_bytes - param_bytes,
            "sample": state_bytes - param_bytes}


def _compile_phase(name: str, spec: StepSpec, sample: SampleShape) -> dict:
    if name == "import":  # peak_bytes: what the import needs beyond the finished base
        return compile_import(spec)
    if name == "state":
        return compile_state(spec)
    if name == "eval":
        return compile_eval(spec)
    limit = spec.model.max_position_embeddings
    return compile_sample(spec, sample.n_prompt(limit), sample.total(limit), sample.temperature,
                          sample.top_k, sample.dtype)


def run_phases(spec: StepSpec, sample: SampleShape | None = None, compile: bool = False,
               step_compiled: dict | None = None, step_measured: int | None = None,
               cache: dict | None = None) -> dict:
    """Every phase with its analytic total and, where compiled, its compiled total; the run's
    peak is the largest phase (compiled numbers where there are any, else analytic).

    step_compiled: compile_step(spec)'s result (the step is compiled by its caller);
    step_measured: the step's measured peak (--measure on a GPU), which then stands for it.
    cache: a dict kept across calls that vary only the micro-batch, remat and accumulation (the
    planner's candidates): import once, state and sample once per mu dtype, eval per micro-batch.
    Returns {"phases": [{name, what, analytic_bytes, compiled_bytes, outside_bytes,
    program_compiled}], "peak_bytes", "peak_phase", "peak_source"}.
    """
    analytic = analytic_phases(spec, sample)
    outside = _held_outside(spec) if compile else {}
    rows = []
    for name in PHASES:
        if name not in analytic:
            continue
        a = analytic[name]
        compiled, program, source = None, None, "analytic"
        if name == "step" and step_compiled is not None:
            compiled, source = int(step_compiled["peak_bytes"]), "compiled"
        elif compile and name != "step":
            key = (name, None if name == "import" else spec.mu_dtype,
                   spec.batch_size if name == "eval" else None)
            program = (cache or {}).get(key) or _compile_phase(name, spec, sample)
            if cache is not None:
                cache[key] = program
            compiled, source = program["peak_bytes"] + outside[name], "compiled"
        if name == "step" and step_measured:
            compiled, source = int(step_measured), "measured"
        rows.append({"name": name, "what": a["what"], "analytic_bytes": int(a["total"]),
                     "compiled_bytes": compiled, "source": source,
                     "outside_bytes": outside.get(name), "program": program})
    best = max(rows, key=lambda r: r["compiled_bytes"] if r["compiled_bytes"] is not None
               else r["analytic_bytes"])
    peak = best["compiled_bytes"] if best["compiled_bytes"] is not None else best["analytic_bytes"]
    return {"phases": rows, "peak_bytes": int(peak), "peak_phase": best["name"],
            "peak_source": best["source"]}


def format_phases(r: dict, unit: str = "GiB") -> str:
    """The phases table: one line each, the largest marked."""
    div = 2**30 if unit == "GiB" else 2**20
    f = lambda n: "-" if n is None else f"{n / div:,.3f}"  # noqa: E731
    lines = [f"phases of the run (the largest sets the verdict; {unit}; * = the largest)",
             f"  {'phase':<8}{'analytic':>12}{'compiled':>12}  what"]
    for row in r["phases"]:
        mark = "*" if row["name"] == r["peak_phase"] else " "
        comp = f(row["compiled_bytes"]) + (" (m)" if row["source"] == "measured" else "")
        lines.append(f"{mark} {row['name']:<8}{f(row['analytic_bytes']):>12}{comp:>12}  "
                     f"{row['what']}")
    return "\n".join(lines)
