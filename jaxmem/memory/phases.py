"""The whole run, not one step: what the device holds while each phase of a run executes.

    SampleShape.of(cfg)                   the end-of-run sample's size (RunConfig.sample)
    analytic_phases(spec, sample)         bytes of each phase from shapes alone
    run_phases(spec, sample, ...)         each phase with its analytic and (compile=True)
                                          compiled peak, and the largest: the run's peak

A run (jaxmem.train.loop) runs these programs one at a time (docs/memory.md's table): import (a
LoRA base, each quantized projection one layer at a time into its stacked result: the base so
far counted whole, an upper bound; a 16-bit checkpoint's layer half the fp32 one counted),
state, step, eval and the end-of-run sample. Each phase's total is its program's peak plus what
the run holds outside it; the step is always compiled, the others with `compile=True`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmem.families.residuals import GATED_MLP
from jaxmem.memory.activations import FP32, layer_residuals, outside_residuals
from jaxmem.memory.analytic import analytic_breakdown
from jaxmem.memory.compiled import compile_phase, sample_params
from jaxmem.memory.counted import (Kind, Where, abstract_frozen, abstract_state, compute_copy,
                                   count_frozen, count_state, largest_param_leaf, tree_bytes)
from jaxmem.memory.spec import StepSpec
from jaxmem.model.attention import query_chunk
from jaxmem.model.remat import RematPolicy
from jaxmem.model.roles import param_role
from jaxmem.model.tiled import mlp_tile, tiles_under
from jaxmem.quant import QuantizedWeight
from jaxmem.loss.chunked import resolve_loss_chunk
from jaxmem.decode.stopping import sample_dtype

PHASES = ("import", "state", "step", "eval", "sample")
# The end-of-run sample's prompt, in tokens: its default is the first line of the eval data cut
# to 60 characters (jaxmem.train.loop.eval_prompt), <= 61 tokens with BOS for any tokenizer.
PROMPT_TOKENS = 64


@dataclass(frozen=True)
class SampleShape:
    """The end-of-run sample: `max_new_tokens` after a prompt of `prompt_tokens` (0: no sample);
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
        return sample_dtype(self.dtype, run_dtype)

    def total(self, limit: int) -> int:  # positions of its token buffer, capped by the model's
        n = self.n_prompt(limit)
        return n + min(self.max_new_tokens, limit - n)

    def n_prompt(self, limit: int) -> int:
        return min(self.prompt_tokens, limit - 1)


def _forward_working_set(spec: StepSpec, B: int, T: int, fused: bool,
                         remat: RematPolicy | None = None) -> int:
    """What a forward pass without a backward holds besides its arguments: the residual stream,
    one layer's activations (freed with the layer), the attention probabilities of one query
    chunk, and the head: the fused loss's one chunk of logits (eval: `fused`) or all [B, T, V]
    logits (today's sampler). remat: the policy the forward's model is built under (the eval's
    EVAL_REMAT); where it tiles the MLP (jaxmem.model.tiled) and a tile is shorter than T, the
    layer holds 3 [B, Tc, F] and the tiles' input and output [B, n Tc, D], not 3 [B, T, F]."""
    c, p = spec.model, spec.precision
    cb = jnp.dtype(p.compute_dtype).itemsize
    D, V, N, F = c.hidden_size, c.vocab_size, c.num_heads, c.intermediate_size
    layer = sum(b for n, b, _ in layer_residuals(c, B, T, p.compute_dtype, RematPolicy("none"),
                                                 "xla") if n != GATED_MLP)
    tile = mlp_tile(B, T, F, D) if remat is not None and tiles_under(remat) else T
    layer += (3 * B * T * F * cb if tile >= T else
              3 * B * tile * F * cb + 2 * B * -(-T // tile) * tile * D * cb)
    attn = B * N * query_chunk((B, T, N), T) * T * (FP32 + cb)  # probabilities fp32 + copy
    stream = 2 * B * T * D * cb + sum(b for n, b, _ in outside_residuals(
        c, B, T, p.compute_dtype, RematPolicy("full"), "xla", 0) if n.startswith("RoPE"))
    if fused:
        chunk = resolve_loss_chunk(spec.loss_chunk, B, T, c) or T
        head = 2 * B * chunk * V * FP32 + 2 * B * T * FP32  # logits, exp; logsumexp, weights
    else:
        head = 2 * B * T * V * FP32  # logits [B, T, V] fp32, and their max-shifted exp
    return stream + max(layer + attn, head)


def _largest_quantized(tree) -> int:
    """Elements of the largest QuantizedWeight of an abstract tree (0: none)."""
    return max((math.prod(q.shape) for q in jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))
        if isinstance(q, QuantizedWeight)), default=0)


def analytic_phases(spec: StepSpec, sample: SampleShape | None = None) -> dict:
    """{phase: {"total": bytes, "what": text}} without compiling: what the device holds in each
    (import: the base and, where quantized, its largest projection three times in fp32: the
    weight read, its blocks, their normalized values)."""
    a = analytic_breakdown(spec)
    c, p = spec.model, spec.precision
    state = sum(x.bytes for x in count_state(spec)
                if x.where is Where.DEVICE and x.kind is not Kind.BATCH)
    B, T = spec.rows, spec.seq_len
    out = {}
    base = abstract_frozen(spec)
    if base is not None:  # LoRA / QLoRA: the frozen base is imported before the state is made
        largest = _largest_quantized(base)
        out["import"] = {"total": tree_bytes(base) + 3 * largest * FP32,
                         "what": "importing the frozen base: " + (
                             "quantized one layer at a time" if largest else "put as stored")}
    # jaxmem.model.typed_init makes a stacked params leaf a layer's slice at a time: its random
    # bits, fp32 values and cast, which XLA:CPU holds apart (8B: 0.58 GiB of temporaries, 2.6
    # fp32 layers of the gate projection; a GPU compile fuses them)
    layer = largest_param_leaf(spec) // c.num_layers * FP32
    if spec.step.optim.state_on_host:  # jaxmem.train.host_state: piece by piece
        made = {"total": state + max(spec.footprint.piece_bytes, layer),
                "what": "making the train state: its device bytes + one piece of a host leaf "
                        "or one layer of a params leaf in fp32"}
    else:
        made = {"total": state + 3 * layer,
                "what": "making the train state: its bytes + 3 fp32 layers of a params leaf"}
    out.update({
        "state": made,
        "step": {"total": a["total_bytes"],
                 "what": f"one train step ({a['peak_phase']} phase at the peak)"},
        "eval": {"total": state + 3 * B * T * 4 + compute_copy(spec, {})
                 + _forward_working_set(spec, B, T, True, spec.footprint.eval_remat),
                 "what": f"evaluation, batch {B} x {T}, fused loss (with the whole state)"},
    })
    if sample is not None and sample.max_new_tokens > 0:
        # the params the sampler is given (sample_params) in its dtype: every floating leaf not
        # a norm nor stored in it cast, and a quantized base's largest projection dequantized
        params, sd = sample_params(spec), jnp.dtype(sample.compute_dtype(p.compute_dtype))
        cast = sum(int(x.size) * sd.itemsize for q, x in jax.tree_util.tree_leaves_with_path(params)
                   if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype) != sd
                   and param_role(q) != "norm") + _largest_quantized(params) * sd.itemsize
        total = sample.total(c.max_position_embeddings)
        out["sample"] = {"total": state + cast + _forward_working_set(spec, 1, total, False),
                         "what": f"end-of-run sample, 1 x {total} tokens (with the whole state)"}
    return out


def run_phases(spec: StepSpec, sample: SampleShape | None = None, compile: bool = False,
               step_compiled: dict | None = None, step_measured: int | None = None,
               cache: dict | None = None) -> dict:
    """Every phase with its analytic total and, where compiled, its compiled total; the run's
    peak is the largest phase (compiled numbers where there are any, else analytic).

    step_compiled: compile_step(spec)'s result (the step is compiled by its caller);
    step_measured: the step's measured peak (--measure on a GPU), which then stands for it.
    cache: a dict kept across calls that vary only the micro-batch, remat and accumulation (the
    planner's candidates): import once, state and sample once per mu dtype, eval per micro-batch.
    """
    analytic = analytic_phases(spec, sample)
    outside = {}
    if compile:  # what the run holds outside each program: the state's parts not its arguments
        # (the device's share: a leaf in pinned host memory is in no device phase)
        held = sum(x.bytes for x in count_state(spec) if x.where is Where.DEVICE
                   and x.kind in (Kind.OPTIMIZER, Kind.LOSS_SCALE, Kind.COUNTERS))
        frozen = sum(x.bytes for x in count_frozen(spec, {}) if x.where is Where.DEVICE)
        # the sampler takes the params as stored and casts them inside its program
        outside = {"import": frozen, "state": frozen, "step": 0, "eval": held, "sample": held}
    rows = []
    for name in (n for n in PHASES if n in analytic):
        compiled, program, source = None, None, "analytic"
        if name == "step" and step_compiled is not None:
            compiled, source = int(step_compiled.get("device_peak_bytes",
                                              step_compiled["peak_bytes"])), "compiled"
        elif compile and name != "step":
            key = (name, None if name == "import" else spec.mu_dtype,
                   spec.batch_size if name == "eval" else None)
            program = (cache or {}).get(key) or compile_phase(name, spec, sample=sample)
            if cache is not None:
                cache[key] = program
            compiled, source = program["peak_bytes"] + outside[name], "compiled"
        if name == "step" and step_measured:
            compiled, source = int(step_measured), "measured"
        rows.append({"name": name, "what": analytic[name]["what"],
                     "analytic_bytes": int(analytic[name]["total"]),
                     "compiled_bytes": compiled, "source": source,
                     "outside_bytes": outside.get(name), "program": program})
    size = lambda r: (r["analytic_bytes"] if r["compiled_bytes"] is None  # noqa: E731
                      else r["compiled_bytes"])
    best = max(rows, key=size)
    return {"phases": rows, "peak_bytes": int(size(best)), "peak_phase": best["name"],
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
