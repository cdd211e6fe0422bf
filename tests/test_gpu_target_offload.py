"""--offload-optimizer host on the H100's own compiler without a GPU (jaxmem.target): the copies
of the optimizer state between pinned host memory and the card overlap the step's compute
(issue 39, "Overlap is visible"), and the planner counts the host-resident state apart.

The tiny preset (4 layers), bf16-sr + adamw8bit, --optimizer-in-backward, 1 x 256. With the
state alone on the host, the reverse layer loop's update brings each stacked optimizer leaf's
sub-piece (codes and scales of both moments) to the device right before its update and writes
it back after; with the weights there too, the loop fetches layer l - 1's weights and state
during iteration l (a prefetch, carried to the next iteration). In the scheduled H100 program
each such copy is an asynchronous `fusion-start` / `fusion-done` pair;
jaxmem.xla.hlo.host_transfers counts them and the compute instructions the schedule puts
between start and done.
"""

from __future__ import annotations

import json
import re

import jax
import pytest

from jaxmem import target
from jaxmem.families import get_preset
from jaxmem.memory.compiled import compile_phase
from jaxmem.memory.counted import abstract_state
from jaxmem.memory.spec import StepSpec
from jaxmem.model.precision import get_precision
from jaxmem.model.remat import RematPolicy
from jaxmem.xla.hlo import host_transfers, parse_hlo

pytestmark = pytest.mark.gpu_target


def spec(offload_params: str = "none") -> StepSpec:
    return StepSpec.of(get_preset("tiny"), get_precision("bf16-sr"), RematPolicy("full"), 1, 256,
                       optimizer="adamw8bit", in_backward=True, offload_optimizer="host",
                       offload_params=offload_params)


@pytest.fixture(scope="module")
def step():
    """The offloaded step compiled for the H100: compile_phase's numbers, with its HLO."""
    with target.compiling_for("h100"):
        return compile_phase("step", spec(), keep_hlo=True)


def _in_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def layer_leaves() -> list:
    """The optimizer state's leaves under "layers": what the layer loop streams."""
    flat = jax.tree_util.tree_flatten_with_path(abstract_state(spec()).opt_state)[0]
    return [leaf for path, leaf in flat if _in_layers(path)]


def host_leaves(offload_params: str) -> list:
    """What --offload-optimizer host keeps in pinned host memory (every array of the optimizer
    state, not its counters) and --offload-params host (the weights' stacked layer leaves)."""
    state = abstract_state(spec(offload_params))
    out = [x for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim]
    if offload_params == "host":
        out += [x for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
                if _in_layers(p)]
    return out


def layer_loop_bodies(hlo: str, layers: int) -> set[str]:
    """The bodies of the module's while loops that run once per layer (known trip count)."""
    bodies = set()
    for comp in parse_hlo(hlo).values():
        for ins in comp["instrs"].values():
            n = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins["attrs"])
            body = re.search(r"\bbody=%?([\w.\-]+)", ins["attrs"])
            if ins["op"] == "while" and n and body and int(n.group(1)) == layers:
                bodies.add(body.group(1))
    return bodies


def synchronous(hlo: str) -> str:
    """The same module with every async fusion and copy made synchronous: the start line
    dropped and its done replaced by one `fusion` (`copy`) of the start's operands (the form a
    copy has without XLA's async host offloading)."""
    starts, out = {}, []
    for line in hlo.splitlines():
        for op in ("fusion", "copy"):
            head, sep, rest = line.partition(f" {op}-start(")
            if sep:
                starts[head.split("=")[0].strip().lstrip("%")] = rest
                break
            head, sep, rest = line.partition(f" {op}-done(")
            if sep:
                name = rest.split(")")[0].lstrip("%")
                out.append(f"{head} {op}({starts.pop(name)}")
                break
        else:
            out.append(line)
    assert not starts, f"starts without a done: {sorted(starts)}"
    return "\n".join(out)


def summary(transfers: list[dict]) -> str:
    return json.dumps([{k: t[k] for k in ("name", "direction", "bytes", "async",
                                          "compute_between")} for t in transfers])


def nested_in(hlo: str, outer: set[str]) -> set[str]:
    """The bodies of the while loops whose while instruction sits in one of `outer`'s bodies."""
    bodies = set()
    for name, comp in parse_hlo(hlo).items():
        if name not in outer:
            continue
        for ins in comp["instrs"].values():
            body = re.search(r"\bbody=%?([\w.\-]+)", ins["attrs"])
            if ins["op"] == "while" and body:
                bodies.add(body.group(1))
    return bodies


def test_the_state_alone_streams_by_sub_piece_with_write_backs_overlapped(step):
    """Only the optimizer state on the host: no prefetch (a layer of state would not fit beside
    the backward on a 24 GB card at 8B); each stacked leaf's sub-piece comes to the device
    right before its update, inside a loop of the layer loop's body, and goes back
    asynchronously, most write-backs with compute in flight. Every copy is async; fetches are
    exposed (the time model counts them: jaxmem.xla.timing). Not every write-back overlaps
    since the 8-bit code search became one kernel (c549620: 8 kernels per moment before): a
    sub-piece's last write-back may follow that kernel directly, 8 of 32 on the tiny H100
    program, which the time model counts as exposed."""
    hlo, layers = step["hlo"], get_preset("tiny").num_layers
    transfers = host_transfers(hlo)
    loop = layer_loop_bodies(hlo, layers)
    assert loop, "no while loop with a trip count of the layer count"
    inner = nested_in(hlo, loop)
    leaves = layer_leaves()
    for direction in ("H2D", "D2H"):
        moved = [t for t in transfers if t["direction"] == direction and t["computation"] in inner]
        assert len(moved) == len(leaves), (direction, len(moved), len(leaves))
        # tiny: one sub-piece per layer, so each moves its layer's slice, once per layer
        assert sum(t["bytes"] for t in moved) * layers == sum(
            x.size * x.dtype.itemsize for x in leaves), direction
    sync = [t for t in transfers if not t["async"]]
    assert not sync, f"synchronous copies: {summary(sync)}"
    backs = [t for t in transfers if t["direction"] == "D2H" and t["computation"] in inner]
    assert 2 * sum(t["compute_between"] > 0 for t in backs) > len(backs), summary(backs)


def test_with_the_weights_on_the_host_the_loop_prefetches():
    """Both flags: the backward loop fetches layer l - 1's weights and state during layer l
    (each leaf's once layer l's gradient of it exists), so many fetches have compute in flight:
    measured 18 of the loop's 41 (tiny, H100 program; fetched right before use it was 2 of 32
    for the state alone); every copy async; no whole host stack copied."""
    with target.compiling_for("h100"):
        both = compile_phase("step", spec("host"), keep_hlo=True)
    hlo, layers = both["hlo"], get_preset("tiny").num_layers
    transfers = host_transfers(hlo)
    back = {t["computation"] for t in transfers if t["direction"] == "D2H"} & \
        layer_loop_bodies(hlo, layers)
    assert len(back) == 1, back  # the backward loop: the one that writes layers back
    fetches = [t for t in transfers if t["direction"] == "H2D" and t["computation"] in back]
    weights = [x for x in host_leaves("host") if x.dtype == jax.numpy.bfloat16]
    assert len(fetches) == len(layer_leaves()) + len(weights)
    ahead = [t for t in fetches if t["compute_between"] > 0]
    assert 3 * len(ahead) > len(fetches), (
        f"{len(ahead)} of the backward loop's {len(fetches)} fetches overlap compute: "
        f"{summary(fetches)}")
    assert not [t for t in transfers if not t["async"]]
    assert both["host_temp_bytes"] == 0


def test_the_streamed_update_copies_no_whole_host_stack(step):
    """A sub-piece's update writes into the host stacks it reads from; XLA must not keep the
    old stack readable by copying it whole in host memory (as it did for the prefetch until an
    optimization_barrier ordered its reads first: experiments/spike39)."""
    assert step["host_temp_bytes"] == 0
    copies = [line for line in step["hlo"].splitlines()
              if re.search(r"S\(5\)\}\s+copy(-start)?\(", line)]
    assert not copies, copies[:3]


def test_the_overlap_check_fails_on_synchronous_copies(step):
    """The negative control: the step's own HLO with its async copies made synchronous is
    reported so (same copies, same bytes, none async, no compute in flight)."""
    hlo = step["hlo"]
    before, after = host_transfers(hlo), host_transfers(synchronous(hlo))
    assert sorted((t["direction"], t["bytes"]) for t in after) == sorted(
        (t["direction"], t["bytes"]) for t in before)
    assert not any(t["async"] or t["compute_between"] for t in after), summary(after)


def test_host_argument_bytes_are_the_offloaded_leaves(step):
    """The planner's host split: exactly the optimizer state's arrays are host arguments
    (memory_analysis()'s host_argument_size_in_bytes), nothing else."""
    host = sum(x.size * x.dtype.itemsize for x in host_leaves("none"))
    assert step["host_source"] == "memory_analysis"
    assert step["host_argument_bytes"] == host


def test_with_the_weights_on_the_host_too():
    """--offload-params host as well: the weights' stacked layer leaves join the host arguments,
    the planner counts the same host bytes as XLA (analytic `host_bytes`), and the device keeps
    only the embedding, head and final norm of the state (its argument bytes)."""
    from jaxmem.memory.analytic import analytic_breakdown
    with target.compiling_for("h100"):
        s = spec("host")
        compiled, analytic = compile_phase("step", s), analytic_breakdown(s)
    host = sum(x.size * x.dtype.itemsize for x in host_leaves("host"))
    assert compiled["host_argument_bytes"] == analytic["host_bytes"] == host
    state = abstract_state(s)
    device = sum(x.size * x.dtype.itemsize for p, x in jax.tree_util.tree_flatten_with_path(
        state.params)[0] if not _in_layers(p))
    # the device's arguments: those params, the counters, the batch (a few hundred bytes more)
    assert device <= compiled["argument_bytes"] < device + 4096, (compiled["argument_bytes"],
                                                                   device)


def test_offload_base_host_is_compiled_with_the_base_on_the_host():
    """--offload-base host on one card (QLoRA): the planner's H100 program takes the frozen
    base's block layers as host arguments (through jaxmem.target.lower; before, the deviceless
    compile dropped their memory kind and counted them as device memory)."""
    from jaxmem.config.run import RunConfig
    from jaxmem.memory.counted import abstract_frozen, tree_bytes
    cfg = RunConfig().replace({"model.preset": "tiny", "peft.lora_rank": 8,
                               "peft.quantize_base": "nf4", "peft.offload_base": "host",
                               "data.batch_size": 1, "data.seq_len": 256})
    s = StepSpec.from_run_config(cfg)
    with target.compiling_for("h100"):
        compiled = compile_phase("step", s)
    host = tree_bytes(abstract_frozen(s)["layers"])  # NF4 codes packed two to a byte
    assert compiled["host_source"] == "memory_analysis"
    assert compiled["host_argument_bytes"] == host > 0


def test_in_backward_keeps_the_layer_inputs_on_the_host_with_remat_offload():
    """--optimizer-in-backward with --remat offload:block_input: the forward's layer inputs
    (L x B x T x D bf16) are host memory of the H100 program (its host temp), exactly what the
    analytic breakdown counts on the host; with --remat full nothing is."""
    from jaxmem.memory.analytic import analytic_breakdown
    got = {}
    with target.compiling_for("h100"):
        for remat in ("full", "offload:block_input"):
            s = StepSpec.of(get_preset("tiny"), get_precision("bf16-sr"),
                            RematPolicy.parse(remat), 1, 512, optimizer="adamw8bit",
                            in_backward=True)
            got[remat] = compile_phase("step", s), analytic_breakdown(s)["host_bytes"]
    m = get_preset("tiny")
    inputs = m.num_layers * 512 * m.hidden_size * 2
    (full, full_host), (off, off_host) = got["full"], got["offload:block_input"]
    assert full["host_temp_bytes"] == full_host == 0
    assert off["host_temp_bytes"] == off_host == inputs


def test_mesh_report_with_remat_offload_alone(capsys):
    """`--remat offload` on a mesh (no state or base offloaded): the per-device report shows the
    activations' host memory and no "without offload" figure (it had raised KeyError)."""
    from jaxmem.memory.cli import main
    assert main(["--preset", "tiny", "--remat", "offload", "--mesh", "fsdp=2", "--devices", "2",
                 "--target", "h100", "--batch-size", "2", "--seq-len", "128",
                 "--analytic-only"]) == 0
    out = capsys.readouterr().out
    assert "analytic, host memory (pinned), per device" in out
    assert "analytic peak without offload" not in out


@pytest.mark.parametrize("offload_params", ["none", "host"])
def test_state_phase_is_the_pieces_not_one_program(offload_params):
    """The planner's state phase compiles jaxmem.train.host_state's programs: its device peak is
    the device-resident leaves, below the one program's, which made the host leaves on the
    device first (as a real GPU did: docs/memory.md, "Measured on a GPU")."""
    from jaxmem.memory.compiled import _lower, compiled_stats, placement
    # 12 layers: a whole stack (12 bf16 layers) is well above the bound below (1.5 fp32 layers)
    s = spec(offload_params).replace(model=get_preset("tiny", num_layers=12))
    with target.compiling_for("h100"):
        par = placement(s, None)
        pieces = compile_phase("state", s)
        one, _ = compiled_stats(_lower(par, par.state_creation(*s.step_config(), seed=0))
                                .compile())
    device = sum(x.size * x.dtype.itemsize for x, sh in zip(
        jax.tree_util.tree_leaves(abstract_state(s)),
        jax.tree_util.tree_leaves(par._placed_shardings(abstract_state(s))))
        if sh.memory_kind != "pinned_host")
    # beside them at most one piece of an optimizer leaf (here a whole leaf: under PIECE_BYTES)
    # or one layer of the largest params leaf in fp32 (and its bf16 slice); a whole params stack
    # made on the device (24 layers' bytes) would exceed both
    layer = max(x.size for x in jax.tree_util.tree_leaves(abstract_state(s).params)) \
        // s.model.num_layers
    piece = max(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(
        abstract_state(s).opt_state) if x.ndim)
    assert device <= pieces["peak_bytes"] <= device + max(piece, 6 * layer) < device + 24 * layer
    assert pieces["peak_bytes"] < one["peak_bytes"]


def test_the_mlp_in_slabs_streams_each_slabs_state_asynchronously(monkeypatch):
    """The in-backward MLP in slabs of F (jaxmem.train.inbackward_slabs; forced on the tiny
    widths by a lower SLAB, as the 8B's 4096 x 14336 weights are cut): each MLP weight's state
    comes to the device a slab at a time inside a loop of the layer loop's body and goes back
    after its update; every copy is async, most write-backs have compute in flight (as in
    the test above), and per layer the state moves once each way: the attention's and norms' by sub-piece, the MLP's
    one slab in the slab loop's body, which runs twice."""
    import jaxmem.train.inbackward_rules as rules
    monkeypatch.setattr(rules, "SLAB", 128 * 256)
    s = StepSpec.of(get_preset("tiny", intermediate_size=512), get_precision("bf16-sr"),
                    RematPolicy("full"), 1, 256, optimizer="adamw8bit", in_backward=True,
                    offload_optimizer="host")
    assert rules.mlp_slabs(s.step, 256) == 256  # 2 slabs of F = 512
    with target.compiling_for("h100"):
        hlo = compile_phase("step", s, keep_hlo=True)["hlo"]
    layers = s.model.num_layers
    transfers, inner = host_transfers(hlo), nested_in(hlo, layer_loop_bodies(hlo, layers))
    flat = jax.tree_util.tree_flatten_with_path(abstract_state(s).opt_state)[0]
    size = lambda want: sum(x.size * x.dtype.itemsize for p, x in flat  # noqa: E731
                            if _in_layers(p) and want(jax.tree_util.keystr(p)))
    mlp, other = size(lambda k: "['mlp']" in k), size(lambda k: "['mlp']" not in k)
    for direction in ("H2D", "D2H"):
        moved = [t for t in transfers if t["direction"] == direction and t["computation"] in inner]
        assert sum(t["bytes"] for t in moved) * layers == other + mlp // 2, direction
    sync = [t for t in transfers if not t["async"]]
    assert not sync, f"synchronous copies: {summary(sync)}"
    backs = [t for t in transfers if t["direction"] == "D2H" and t["computation"] in inner]
    assert backs and 2 * sum(t["compute_between"] > 0 for t in backs) > len(backs), \
        summary(backs)
