"""jaxmem.xla.collectives: bytes per device per step from an optimized HLO text.

Checked on a hand-written module in the formats XLA's GPU backend prints (async pairs, an
async-start wrapping a reduce-scatter, known_trip_count in backend_config, the three forms of
replica_groups), with every figure computed by hand in the comments.
"""

import pytest

from jaxmem.xla.collectives import (collective_counts, comm_report, find_collectives,
                                       format_comm_table, fsdp_volume, group_size, ring_bytes)

# Two nested loops (3 x 4 runs) around an all-gather-start/done with a fusion between, an
# async reduce-scatter and a two-operand reduce-scatter-start; in ENTRY a sync all-reduce (mesh-form groups), a collective-permute pair
# with a fusion between, a fusion calling a sync all-gather twice; a while with no trip count
# around an all-to-all (iota groups); a computation nothing calls, holding an all-reduce.
MODULE = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[256]{0})->f32[256]{0}}, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs_comp (p: f32[64,16]) -> f32[8,16] {
  %p = f32[64,16]{1,0} parameter(0)
  ROOT %rs = f32[8,16]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

%fused (x: f32[64,16]) -> f32[64,16] {
  %x = f32[64,16]{1,0} parameter(0)
  ROOT %n = f32[64,16]{1,0} negate(%x)
}

%fused_ag (e: bf16[1,4]) -> bf16[8,4] {
  %e = bf16[1,4]{1,0} parameter(0)
  ROOT %g = bf16[8,4]{1,0} all-gather(%e), channel_id=7, replica_groups={}, dimensions={0}
}

%dead (d: f32[32]) -> f32[32] {
  %d = f32[32]{0} parameter(0)
  ROOT %dr = f32[32]{0} all-reduce(%d), channel_id=9, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%cond (c: (s32[], bf16[2,32], f32[64,16])) -> pred[] {
  %c = (s32[], bf16[2,32]{1,0}, f32[64,16]{1,0}) parameter(0)
  ROOT %true = pred[] constant(true)
}

%inner_body (p: (s32[], bf16[2,32], f32[64,16])) -> (s32[], bf16[2,32], f32[64,16]) {
  %p = (s32[], bf16[2,32]{1,0}, f32[64,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[2,32]{1,0} get-tuple-element(%p), index=1
  %ag = (bf16[2,32]{1,0}, bf16[16,32]{1,0}) all-gather-start(%w), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/while/body/dot_general"}
  %x = f32[64,16]{1,0} get-tuple-element(%p), index=2
  %m = f32[64,16]{1,0} fusion(%x), kind=kLoop, calls=%fused
  %agd = bf16[16,32]{1,0} all-gather-done(%ag)
  %bc = bf16[16,32]{1,0} bitcast(%agd)
  %rs2 = ((f32[64,16]{1,0}, f32[64,16]{1,0}), (f32[64,2]{1,0}, f32[64,2]{1,0})) reduce-scatter-start(%x, %m), channel_id=4, replica_groups=mesh['a'=1,'b'=8] {'b'}, dimensions={1}, to_apply=%add
  %rs2d = (f32[64,2]{1,0}, f32[64,2]{1,0}) reduce-scatter-done(%rs2)
  %rss = ((f32[64,16]{1,0}), f32[8,16]{1,0}) async-start(%m), calls=%rs_comp, backend_config={"collective_backend_config":{"is_sync":true}}
  %rsd = f32[8,16]{1,0} async-done(%rss)
  ROOT %t = (s32[], bf16[2,32]{1,0}, f32[64,16]{1,0}) tuple(%i, %w, %x)
}

%outer_body (p: (s32[], bf16[2,32], f32[64,16])) -> (s32[], bf16[2,32], f32[64,16]) {
  %p = (s32[], bf16[2,32]{1,0}, f32[64,16]{1,0}) parameter(0)
  ROOT %inner = (s32[], bf16[2,32]{1,0}, f32[64,16]{1,0}) while(%p), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"0","step":"1"}}
}

%cond2 (c: (s32[], s32[8,4])) -> pred[] {
  %c = (s32[], s32[8,4]{1,0}) parameter(0)
  ROOT %true2 = pred[] constant(true)
}

%loose_body (p: (s32[], s32[8,4])) -> (s32[], s32[8,4]) {
  %p = (s32[], s32[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %q = s32[8,4]{1,0} get-tuple-element(%p), index=1
  %a2a = s32[8,4]{1,0} all-to-all(%q), channel_id=8, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %t2 = (s32[], s32[8,4]{1,0}) tuple(%i, %a2a)
}

ENTRY %main (w: bf16[2,32], x: f32[64,16], y: f32[256], z: f32[100], q: s32[8,4], e: bf16[1,4]) -> f32[256] {
  %w = bf16[2,32]{1,0} parameter(0)
  %x = f32[64,16]{1,0} parameter(1)
  %y = f32[256]{0} parameter(2)
  %z = f32[100]{0} parameter(3)
  %q = s32[8,4]{1,0} parameter(4)
  %e = bf16[1,4]{1,0} parameter(5)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,32]{1,0}, f32[64,16]{1,0}) tuple(%zero, %w, %x)
  %outer = (s32[], bf16[2,32]{1,0}, f32[64,16]{1,0}) while(%init), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = f32[256]{0} all-reduce(%y), channel_id=5, replica_groups=mesh['a'=4,'b'=2] {'b'}, use_global_device_ids=true, to_apply=%add
  %cp = (f32[100]{0}, f32[100]{0}, u32[], u32[]) collective-permute-start(%z), channel_id=6, source_target_pairs={{0,1},{1,0}}
  %f1 = bf16[8,4]{1,0} fusion(%e), kind=kLoop, calls=%fused_ag
  %cpd = f32[100]{0} collective-permute-done(%cp)
  %f2 = bf16[8,4]{1,0} fusion(%e), kind=kLoop, calls=%fused_ag
  %init2 = (s32[], s32[8,4]{1,0}) tuple(%zero, %q)
  %loose = (s32[], s32[8,4]{1,0}) while(%init2), condition=%cond2, body=%loose_body
  ROOT %r = f32[256]{0} add(%ar, %ar)
}
"""


def by_name():
    return {c.name: c for c in find_collectives(MODULE)}


def test_each_collective_bytes_runs_and_group_by_hand():
    c = by_name()
    # dead's all-reduce is never called; the reduce-scatter inside rs_comp is counted at its
    # async-start (rss), not again where it is written.
    assert set(c) == {"ag", "rss", "rs2", "ar", "cp", "g", "a2a"}
    # all-gather of output bf16[16,32] = 1024 B over 8: 1024 x 7/8 = 896 B, loops 3 x 4 = 12.
    assert (c["ag"].group_size, c["ag"].data_bytes, c["ag"].bytes_per_run, c["ag"].runs) == \
        (8, 1024, 896.0, 12)
    # reduce-scatter to f32[8,16] = 512 B: input 8 x 512 = 4096 B, 4096 x 7/8 = 3584 B, 12 runs.
    assert (c["rss"].kind, c["rss"].data_bytes, c["rss"].bytes_per_run, c["rss"].runs) == \
        ("reduce-scatter", 4096, 3584.0, 12)
    # reduce-scatter-start to two f32[64,2] (1024 B): input 8 x 1024 = 8192 B, x 7/8 = 7168 B.
    assert (c["rs2"].kind, c["rs2"].data_bytes, c["rs2"].bytes_per_run, c["rs2"].runs) == \
        ("reduce-scatter", 8192, 7168.0, 12)
    # all-reduce of f32[256] = 1024 B over axis 'b' (2 devices): 2 x 1024 x 1/2 = 1024 B.
    assert (c["ar"].group_size, c["ar"].bytes_per_run, c["ar"].runs) == (2, 1024.0, 1)
    # collective-permute of f32[100]: its operand, 400 B.
    assert (c["cp"].kind, c["cp"].bytes_per_run) == ("collective-permute", 400.0)
    # all-gather in a fusion called twice, groups {} = all 8 devices: bf16[8,4] 64 B x 7/8.
    assert (c["g"].group_size, c["g"].bytes_per_run, c["g"].runs) == (8, 56.0, 2)
    # all-to-all of s32[8,4] = 128 B over iota groups [2,4] (4 devices): 128 x 3/4 = 96 B,
    # under a while without a trip count: once, and flagged.
    assert (c["a2a"].group_size, c["a2a"].bytes_per_run, c["a2a"].runs) == (4, 96.0, 1)
    assert c["a2a"].uncertain == ("loose (while, no known trip count: counted once)",)
    assert c["ag"].op_name == "jit(step)/while/body/dot_general"


def test_async_pairs_and_compute_between():
    c = by_name()
    # ag: a get-tuple-element (free) and the fusion %m (compute) before its done.
    assert (c["ag"].asynchronous, c["ag"].compute_between, c["ag"].forced_sync) == (True, 1, False)
    # rss: done right after its start; XLA's backend_config says is_sync.
    assert (c["rss"].asynchronous, c["rss"].compute_between, c["rss"].forced_sync) == \
        (True, 0, True)
    # cp: the fusion %f1 between start and done.
    assert (c["cp"].asynchronous, c["cp"].compute_between) == (True, 1)
    # rs2: its done right after its start, nothing between.
    assert (c["rs2"].asynchronous, c["rs2"].compute_between) == (True, 0)
    assert [c[n].asynchronous for n in ("ar", "g", "a2a")] == [False] * 3
    assert [c[n].compute_between for n in ("ar", "g", "a2a")] == [None] * 3


def test_report_totals_per_kind():
    r = comm_report(MODULE)
    assert r["devices"] == 8
    sent = {k: v["send_bytes"] for k, v in r["by_kind"].items()}
    # 896 x 12 + 56 x 2; (3584 + 7168) x 12; 1024; 96; 400
    assert sent == {"all-gather": 10864.0, "reduce-scatter": 129024.0, "all-reduce": 1024.0,
                    "all-to-all": 96.0, "collective-permute": 400.0}
    assert r["send_bytes"] == r["recv_bytes"] == 141408.0
    assert r["by_kind"]["all-gather"]["runs"] == 14 and r["by_kind"]["all-gather"]["ops"] == 2
    assert r["async"] == {"pairs": 4, "with_compute_between": 2, "forced_sync": 1,
                          "done_elsewhere": 0}
    assert r["synchronous"] == 3
    assert r["uncertain"] == ["a2a: loose (while, no known trip count: counted once)"]
    assert collective_counts(MODULE) == {"all-gather": 2, "reduce-scatter": 2, "all-reduce": 1,
                                         "all-to-all": 1, "collective-permute": 1}


def test_table_states_totals_and_theory():
    table = format_comm_table(comm_report(MODULE), param_bytes=2**30, group=8)
    # FSDP theory: 3 x 1 GiB x 7/8 = 2.625 GiB, printed rounded.
    assert "| FSDP theory: 3 x 1.00 GiB params x (8-1)/8 | | | 2.62 GiB" in table
    assert "async pairs: 4, 2 with compute scheduled between start and done, 1 marked is_sync" \
        in table


@pytest.mark.parametrize("attrs, n", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 4),
    ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 2),
    ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}", 8),
    ("replica_groups=mesh['x'=2,'y'=2,'z'=2] {'x','z'}, dimensions={0}", 4),
    ("replica_groups={}, dimensions={0}", 16),
    ("dimensions={0}", 16),
])
def test_group_size_forms(attrs, n):
    assert group_size(attrs, devices=16) == n


def test_ring_model_and_fsdp_volume():
    assert ring_bytes("all-gather", 800, 8) == 700
    assert ring_bytes("reduce-scatter", 800, 8) == 700
    assert ring_bytes("all-reduce", 800, 8) == 1400
    assert ring_bytes("all-to-all", 800, 8) == 700
    assert ring_bytes("collective-permute", 800, 8) == 800
    assert ring_bytes("all-reduce", 800, 1) == 0
    assert fsdp_volume(800, 8) == 2100
