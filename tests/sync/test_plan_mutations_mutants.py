"""The planner's planted bugs read exactly (mutation testing of ``sync/mutations.py``): each
mutation applied to a small correct plan, its transfers compared with the ones its docstring
describes, written out (which transfer is cut where, which lands where, which is dropped or
one index longer), and every ``NotApplicable`` it raises word for word. The moving parts
(``_first_run``, ``_split``, ``_narrow``, ``_moved``, ``swap_positions``) on hand-made
transfers and pieces, ``box_overlap``'s choice of transfer on hand-made plans. Each mutated
plan is named after its mutation; the twin of each exact comparison is the unmutated plan
pinned beside it (the harness's, every element written once), and of each refusal a plan
the mutation applies to. All on tiny geometries: the file runs in about a second."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.conventions.maps import Piece
from weight_sync_bench.sync import plan_for, sync_layout
from weight_sync_bench.sync.mutations import (
    PLAN_MUTATIONS,
    NotApplicable,
    PlanMutation,
    _first_run,
    _moved,
    _narrow,
    _split,
    box_overlap,
    dropped_transfer,
    dst_ranks_swapped,
    experts_swapped,
    gate_up_swapped,
    kv_replica_off_by_one,
    qk_swapped,
    stages_publish_local_indices,
    swap_positions,
)
from weight_sync_bench.sync.planner import Plan, Transfer

QKV = "model.layers.0.self_attn.qkv_proj.weight"
GATE_UP = "model.layers.0.mlp.gate_up_proj.weight"
MEGATRON_QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
MEGATRON_FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
MOE = tiny(4, n_experts=4, top_k=2, expert_ffn=16)
W13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"


def _plan(config, src, dst):
    return plan_for(sync_layout(config, src), sync_layout(config, dst))


def _m4_v2():
    """tiny(4): 8 Q heads, 4 KV heads, head_dim 8, ffn 64, d_model 32; megatron:4 -> vllm:2."""
    return _plan(tiny(4), "megatron:4", "vllm:2")


def _rows(param, src_name, dst_name, src_rank, dst_rank, rows, src_row, dst_row, width=32):
    """A transfer of whole rows ``rows`` (canonical start, stop) of a [*, width] parameter."""
    return Transfer(param, src_rank, src_name, dst_rank, dst_name, (rows, (0, width)),
                    (src_row, 0), (dst_row, 0))


def _qkv(src_rank, dst_rank, rows, src_row, dst_row, src_name=MEGATRON_QKV, dst_name=QKV):
    return _rows("layers.0.qkv.weight", src_name, dst_name, src_rank, dst_rank, rows, src_row,
                 dst_row)


def _gate_up(src_rank, dst_rank, rows, src_row, dst_row):
    return _rows("layers.0.gate_up.weight", MEGATRON_FC1, GATE_UP, src_rank, dst_rank, rows,
                 src_row, dst_row)


def _not_applicable(mutation, plan):
    with pytest.raises(NotApplicable) as info:
        mutation(plan)
    return str(info.value)


def _into(plan, rank, name):
    return [t for t in plan.transfers if (t.dst_rank, t.dst_name) == (rank, name)]


# -- the moving parts


def _piece(idx):
    return Piece("layers.0.qkv.weight", 0, torch.tensor(idx, dtype=torch.int64))


def test_first_run_is_the_first_run_of_consecutive_positions_holding_the_range():
    # positions 1, 2, 3 hold 0, 1, 2 (a run), 4 holds the stop, 5 and 6 hold 3 and 1 again
    piece = _piece([5, 0, 1, 2, 4, 3, 1])
    assert _first_run(piece, 0, 4) == (1, 3)
    assert _first_run(piece, 1, 4) == (2, 2)  # the start is inclusive, the stop exclusive
    assert _first_run(piece, 4, 6) == (0, 1)  # 5 at 0, then 4 at position 4: not a run
    # a run of one, of two, and a run that reaches the last position
    assert _first_run(_piece([7, 0, 9, 1]), 0, 2) == (1, 1)
    assert _first_run(_piece([9, 0, 1, 9, 2]), 0, 3) == (1, 2)
    assert _first_run(_piece([9, 0, 1]), 0, 2) == (1, 2)
    assert _first_run(_piece([3, 4, 5]), 0, 9) == (0, 3)
    # nothing of the range held: no run
    assert _first_run(piece, 50, 60)[1] == 0


def _transfer():
    return Transfer("p", 0, "s", 1, "d", ((10, 20), (0, 4)), (3, 0), (100, 2))


def test_split_cuts_a_transfer_where_its_destination_reaches_a_position():
    t = _transfer()
    assert _split(t, 0, 105) == [
        Transfer("p", 0, "s", 1, "d", ((10, 15), (0, 4)), (3, 0), (100, 2)),
        Transfer("p", 0, "s", 1, "d", ((15, 20), (0, 4)), (8, 0), (105, 2))]
    assert _split(t, 1, 3) == [
        Transfer("p", 0, "s", 1, "d", ((10, 20), (0, 1)), (3, 0), (100, 2)),
        Transfer("p", 0, "s", 1, "d", ((10, 20), (1, 4)), (3, 1), (100, 3))]
    # at either end of the transfer, or outside it: no cut
    for dim, at in ((0, 100), (0, 110), (0, 99), (0, 111), (0, 10), (1, 2), (1, 6)):
        assert _split(t, dim, at) == [t], (dim, at)


def test_narrow_and_moved_keep_the_corners_in_step():
    t = _transfer()
    assert _narrow(t, 1, 2, 4) == Transfer("p", 0, "s", 1, "d", ((10, 20), (2, 4)), (3, 2),
                                           (100, 4))
    assert _narrow(t, 0, 12, 13) == Transfer("p", 0, "s", 1, "d", ((12, 13), (0, 4)), (5, 0),
                                             (102, 2))
    assert _narrow(t, 0, 10, 20) == t
    assert _moved(t, 1, -2) == Transfer("p", 0, "s", 1, "d", ((10, 20), (0, 4)), (3, 0),
                                        (100, 0))
    assert _moved(t, 0, 7) == replace(t, dst_at=(107, 2))


def test_swap_positions_exchanges_two_ranges_of_one_destination_tensor():
    plan = _m4_v2()
    t = list(plan.transfers)
    # rank 0's fused qkv: Q heads 0-3 (rows 0-31: 0-15 local, 16-31 from rank 1), then
    # K heads 0-1 at 32-47 and V heads 0-1 at 48-63, each half local, half from rank 1
    assert t[4:10] == [_qkv(0, 0, (0, 16), 0, 0), _qkv(1, 0, (16, 32), 0, 16),
                       _qkv(0, 0, (64, 72), 16, 32), _qkv(1, 0, (72, 80), 16, 40),
                       _qkv(0, 0, (96, 104), 24, 48), _qkv(1, 0, (104, 112), 24, 56)]
    swapped = swap_positions(plan, 0, QKV, 0, 4, 36, 8, "m")
    assert swapped.mutation == "m" and swapped.label == "megatron:4 -> vllm:2 (mutation m)"
    # positions 4-11 <-> 36-43: every transfer cut at 4, 12, 36 and 44 first
    assert list(swapped.transfers) == t[:4] + [
        _qkv(0, 0, (0, 4), 0, 0), _qkv(0, 0, (4, 12), 4, 36), _qkv(0, 0, (12, 16), 12, 12),
        t[5],
        _qkv(0, 0, (64, 68), 16, 32), _qkv(0, 0, (68, 72), 20, 4),
        _qkv(1, 0, (72, 76), 16, 8), _qkv(1, 0, (76, 80), 20, 44),
        t[8], t[9]] + t[10:]
    assert swapped.writes() == ()  # every element still written once
    # the twin: the plan it was given is as it was, and a tensor no transfer writes: no change
    assert list(plan.transfers) == t and plan.mutation is None
    same = swap_positions(plan, 0, "no such tensor", 0, 4, 36, 8, "m")
    assert same.transfers == plan.transfers and same.mutation == "m"


def test_swap_positions_moves_a_whole_transfer_by_the_distance_between_the_ranges():
    plan = _m4_v2()
    t = list(plan.transfers)
    swapped = swap_positions(plan, 0, QKV, 0, 0, 32, 16, "m")
    assert list(swapped.transfers) == t[:4] + [
        _qkv(0, 0, (0, 16), 0, 32), t[5], _qkv(0, 0, (64, 72), 16, 0),
        _qkv(1, 0, (72, 80), 16, 8)] + t[8:]
    # rank 1's tensor of the same name: untouched
    assert _into(swapped, 1, QKV) == _into(plan, 1, QKV)


# -- qk_swapped, gate_up_swapped


def test_qk_swapped_exchanges_rank_0s_first_q_head_and_first_k_head():
    plan = _m4_v2()
    t = list(plan.transfers)
    mutated = qk_swapped(plan)
    assert mutated.mutation == "qk_swapped"
    assert list(mutated.transfers) == t[:4] + [
        _qkv(0, 0, (0, 8), 0, 32), _qkv(0, 0, (8, 16), 8, 8), t[5],
        _qkv(0, 0, (64, 72), 16, 0)] + t[7:]
    assert mutated.writes() == () and plan.writes() == ()
    assert PLAN_MUTATIONS["qk_swapped"](plan).transfers == mutated.transfers


def test_qk_swapped_where_rank_0_holds_exactly_one_k_head():
    # tiny(2) at vllm:2: rank 0 holds Q heads 0-3 (rows 0-31) and K head 0 (8 rows) alone
    plan = _plan(tiny(2), "megatron:2", "vllm:2")
    assert _into(plan, 0, QKV) == [_qkv(0, 0, (0, 32), 0, 0), _qkv(0, 0, (64, 72), 32, 32),
                                   _qkv(0, 0, (80, 88), 40, 40)]
    mutated = qk_swapped(plan)
    assert _into(mutated, 0, QKV) == [_qkv(0, 0, (0, 8), 0, 32), _qkv(0, 0, (8, 32), 8, 8),
                                      _qkv(0, 0, (64, 72), 32, 0), _qkv(0, 0, (80, 88), 40, 40)]
    assert [t for t in mutated.transfers if (t.dst_rank, t.dst_name) != (0, QKV)] == \
        [t for t in plan.transfers if (t.dst_rank, t.dst_name) != (0, QKV)]


def test_the_swaps_read_destination_rank_0_even_where_rank_1_holds_another_layer():
    # pipeline stages on the destination: rank 0 holds layer 0, rank 1 layer 1 only (under
    # its local index: ``decoder.layers.0.``)
    plan = _plan(tiny(4, n_layers=2), "vllm:2", "megatron:tp=1,pp=2")
    assert {p.source.split(".")[1] for p in plan.dst.parts[1].values()
            if p.source.startswith("layers.")} == {"1"}
    for mutation in (qk_swapped, gate_up_swapped):
        mutated = mutation(plan)
        changed = set(mutated.transfers) ^ set(plan.transfers)
        assert changed and {x.dst_rank for x in changed} == {0}
        assert mutated.writes() == ()


def test_gate_up_swapped_exchanges_rank_0s_gate_rows_and_up_rows():
    plan = _m4_v2()
    t = list(plan.transfers)
    assert t[22:26] == [_gate_up(0, 0, (0, 16), 0, 0), _gate_up(1, 0, (16, 32), 0, 16),
                        _gate_up(0, 0, (64, 80), 16, 32), _gate_up(1, 0, (80, 96), 16, 48)]
    mutated = gate_up_swapped(plan)
    assert mutated.mutation == "gate_up_swapped"
    assert list(mutated.transfers) == t[:22] + [
        _gate_up(0, 0, (0, 16), 0, 32), _gate_up(1, 0, (16, 32), 0, 48),
        _gate_up(0, 0, (64, 80), 16, 0), _gate_up(1, 0, (80, 96), 16, 16)] + t[26:]
    assert mutated.writes() == ()


def test_gate_up_swapped_swaps_as_many_rows_as_the_shorter_run_holds():
    # rank 0's gate_up made to hold 8 gate rows (56-63), then all 64 up rows: 8 exchanged
    plan = _plan(tiny(4), "vllm:1", "vllm:1")
    (t,) = _into(plan, 0, GATE_UP)
    assert t.region == ((0, 128), (0, 32))
    pieces = [dict(p) for p in plan.dst.pieces]
    pieces[0][GATE_UP] = Piece("layers.0.gate_up.weight", 0, torch.arange(56, 128))
    held = replace(plan, dst=replace(plan.dst, pieces=tuple(pieces)),
                   transfers=tuple(replace(x, region=((56, 128), (0, 32)), src_at=(56, 0))
                                   if x == t else x for x in plan.transfers))
    mutated = gate_up_swapped(held)
    assert _into(mutated, 0, GATE_UP) == [
        replace(t, region=((56, 64), (0, 32)), src_at=(56, 0), dst_at=(8, 0)),
        replace(t, region=((64, 72), (0, 32)), src_at=(64, 0), dst_at=(0, 0)),
        replace(t, region=((72, 128), (0, 32)), src_at=(72, 0), dst_at=(16, 0))]


# -- kv_replica_off_by_one


def test_kv_replica_off_by_one_fetches_the_next_kv_head_for_the_first_rank_before_a_change():
    # tiny(2) at vllm:4: KV head 0 on ranks 0-1, head 1 on ranks 2-3: rank 1 gets head 1
    plan = _plan(tiny(2), "megatron:2", "vllm:4")
    t = list(plan.transfers)
    declared = plan.dst.parts[1][QKV].idx.clone()
    assert t[13:16] == [_qkv(0, 1, (16, 32), 16, 0), _qkv(0, 1, (64, 72), 32, 16),
                        _qkv(0, 1, (80, 88), 40, 24)]
    assert _into(plan, 1, QKV) == t[13:16]
    mutated = kv_replica_off_by_one(plan)
    assert mutated.mutation == "kv_replica_off_by_one"
    # rank 1's qkv replanned from a copy of rank 2's K and V head (rank 1's own source, the
    # Megatron rank holding group 1: local copies), appended; everything else kept in order
    assert list(mutated.transfers) == t[:13] + t[16:] + [
        _qkv(0, 1, (16, 32), 16, 0), _qkv(1, 1, (72, 80), 32, 16), _qkv(1, 1, (88, 96), 40, 24)]
    assert mutated.writes() == ()
    # the plan still claims the declared layout, left as it was
    assert mutated.dst is plan.dst and torch.equal(plan.dst.parts[1][QKV].idx, declared)


def test_kv_replica_off_by_one_on_eight_ranks_shifts_by_one_head():
    # tiny(2) at vllm:8 would be 4 ranks per head; tiny(4) at vllm:8: 2 ranks per head
    plan = _plan(tiny(4), "megatron:4", "vllm:8")
    mutated = kv_replica_off_by_one(plan)
    assert [(x.region[0], x.dst_at[0]) for x in _into(plan, 1, QKV)] == [
        ((8, 16), 0), ((64, 72), 8), ((96, 104), 16)]
    assert [(x.region[0], x.dst_at[0]) for x in _into(mutated, 1, QKV)] == [
        ((8, 16), 0), ((72, 80), 8), ((104, 112), 16)]
    assert _into(mutated, 3, QKV) == _into(plan, 3, QKV)


# -- dst_ranks_swapped


def test_dst_ranks_swapped_exchanges_destination_ranks_0_and_1_only():
    plan = _plan(tiny(4), "megatron:4", "vllm:4")
    assert {x.dst_rank for x in plan.transfers} == {0, 1, 2, 3}
    mutated = dst_ranks_swapped(plan)
    assert mutated.mutation == "dst_ranks_swapped"
    swap = {0: 1, 1: 0, 2: 2, 3: 3}
    assert list(mutated.transfers) == [replace(x, dst_rank=swap[x.dst_rank])
                                       for x in plan.transfers]
    # on two destination ranks too
    two = _m4_v2()
    assert list(dst_ranks_swapped(two).transfers) == [replace(x, dst_rank=1 - x.dst_rank)
                                                      for x in two.transfers]


# -- box_overlap


def test_box_overlap_lengthens_the_first_remote_transfer_forward_into_a_local_copy():
    plan = _m4_v2()
    t = list(plan.transfers)
    mutated = box_overlap(plan)
    assert mutated.mutation == "box_overlap"
    # transfer 5 (rows 16-31 from rank 1 at 16) takes one row more: rank 1's stored row 16
    # (its K row 72) over position 32, where the local copy writes K row 64
    assert list(mutated.transfers) == t[:5] + [_qkv(1, 0, (16, 33), 0, 16)] + t[6:]
    assert mutated.writes()[0] == "1 destination tensors written twice, 0 with elements never " \
        "written"


def test_box_overlap_lengthens_backward_where_forward_has_nothing_to_overlap():
    plan = _plan(tiny(4), "fsdp:4", "plain:2")
    t = list(plan.transfers)
    name = "layers.0.qkv.weight"
    assert t[15:17] == [_qkv(1, 1, (32, 64), 0, 0, name, name), _qkv(2, 1, (80, 96), 16, 32,
                                                                      name, name)]
    mutated = box_overlap(plan)
    assert list(mutated.transfers) == t[:16] + [_qkv(2, 1, (79, 96), 15, 31, name, name)] + \
        t[17:]


def test_box_overlap_lengthens_a_transfer_into_a_member_of_a_stacked_tensor():
    plan = _plan(MOE, "megatron:tp=2,ep=2", "vllm:tp=2,ep=2")
    t = list(plan.transfers)
    src = "decoder.layers.0.mlp.experts.linear_fc1.weight0"
    member = Transfer("layers.0.experts.gate_up.weight", 1, src, 0, f"{W13}[0]",
                      ((8, 16), (0, 32)), (0, 0), (8, 0))
    assert t[23] == member
    assert list(box_overlap(plan).transfers) == t[:23] + [
        replace(member, region=((8, 17), (0, 32)))] + t[24:]


def _bordering(dst_idx, src_idx, transfers, other=()):
    """A hand-made plan over plain:2's layouts: destination rank 0 stores "d", source ranks 0
    and 1 store "s" (1-D canonical indices as given), and ``transfers`` (src rank, canonical
    start, stop, src at, dst at) from "s" into "d"; ``other``: transfers placed first, from
    source rank 1's "f" (stored along dim 1) into rank 0's "e" (along dim 0)."""
    base = sync_layout(tiny(4), "plain:2")

    def piece(idx, dim=0):
        return Piece("norm.weight", dim, torch.tensor(idx, dtype=torch.int64))

    dst = replace(base, pieces=({"d": piece(dst_idx), "e": piece([0, 1])}, {}))
    src = replace(base, pieces=({"s": piece(src_idx[0])},
                                {"s": piece(src_idx[1]), "f": piece([0, 1], dim=1)}))
    moves = [Transfer("norm.weight", 1, "f", 0, "e", ((a, b),), (a,), (a,)) for a, b in other]
    moves += [Transfer("norm.weight", r, "s", 0, "d", ((a, b),), (at,), (to,))
              for r, a, b, at, to in transfers]
    return Plan(src, dst, tuple(moves), 0.0)


def _longer(plan, index):
    """The transfers ``box_overlap`` returns, and the one at ``index`` as (region, at, to)."""
    mutated = box_overlap(plan)
    rest = [x for i, x in enumerate(mutated.transfers) if i != index]
    assert rest == [x for i, x in enumerate(plan.transfers) if i != index]
    t = mutated.transfers[index]
    return t.region[0], t.src_at[0], t.dst_at[0]


def test_box_overlap_tries_backward_from_position_0_where_forward_repeats_the_declared_index():
    # local 0 at 0; remote 1-2 from rank 1 at 1; local 3-5 at 3. One longer forward, rank 1's
    # index 3 would land where index 3 is declared (no bug): backward it is, onto position 0
    transfers = [(0, 0, 1, 0, 0), (1, 1, 3, 1, 1), (0, 3, 6, 1, 3)]
    plan = _bordering(range(6), ([0, 3, 4, 5], [9, 1, 2, 3]), transfers)
    assert _longer(plan, 1) == ((0, 3), 0, 0)
    # transfers from a tensor stored along another dim than the destination's: passed over
    plan = _bordering(range(6), ([0, 3, 4, 5], [9, 1, 2, 3]), transfers, other=[(0, 2)])
    assert _longer(plan, 2) == ((0, 3), 0, 0)
    # the twin: where rank 1 holds index 0 before index 1, the longer transfer would be right
    plan = _bordering(range(6), ([0, 3, 4, 5], [0, 1, 2, 3]), transfers)
    assert _not_applicable(box_overlap, plan) == \
        "plain:2 -> plain:2: no remote transfer borders a local copy"


def test_box_overlap_tries_backward_where_forward_borders_a_remote_transfer():
    # local 0-1 at 0; remote 2-3 (rank 1 at 1) at 2; remote 4-5 at 4: forward is not a local
    # copy's position, backward (position 1) is
    transfers = [(0, 0, 2, 0, 0), (1, 2, 4, 1, 2), (1, 4, 6, 4, 4)]
    plan = _bordering(range(6), ([0, 1], [9, 2, 3, 9, 4, 5]), transfers)
    assert _longer(plan, 1) == ((1, 4), 0, 1)


def test_box_overlap_marks_only_the_positions_a_local_copy_writes():
    # remote 0-1 at 0, remote 2-3 at 2, local 4-7 at 4: only the second borders the copy
    transfers = [(1, 0, 2, 0, 0), (1, 2, 4, 3, 2), (0, 4, 8, 0, 4)]
    plan = _bordering(range(8), ([4, 5, 6, 7], [0, 1, 9, 2, 3, 9]), transfers)
    assert _longer(plan, 1) == ((2, 5), 3, 2)
    # a local copy of indices 4-5 at positions 0-1, then remote 0-1 at 2 and 2-3 at 4: the
    # copy's positions end at 1, so nothing borders it with another index
    transfers = [(0, 4, 6, 0, 0), (1, 0, 2, 0, 2), (1, 2, 4, 3, 4)]
    plan = _bordering([4, 5, 0, 1, 2, 3], ([4, 5], [0, 1, 7, 2, 3]), transfers)
    assert _not_applicable(box_overlap, plan) == \
        "plain:2 -> plain:2: no remote transfer borders a local copy"


# -- dropped_transfer


def test_dropped_transfer_leaves_out_the_last_of_the_largest_remote_transfers():
    plan = _m4_v2()
    t = list(plan.transfers)
    # the local copies are 4096 elements, the remote ones at most 512: the last is 33's
    assert max(x.numel for x in t if x.local) == 4096
    assert [i for i, x in enumerate(t) if not x.local and x.numel == 512][-1] == 33
    mutated = dropped_transfer(plan)
    assert mutated.mutation == "dropped_transfer"
    assert list(mutated.transfers) == t[:33] + t[34:]
    assert mutated.writes()[1] == ("rank 1 model.layers.0.mlp.down_proj.weight: 512 of 1024 "
                                   "elements never written")


def test_dropped_transfer_prefers_the_larger_transfer_to_the_later_one():
    plan = _plan(tiny(4), "megatron:2", "fsdp:2")
    t = list(plan.transfers)
    remote = [(x.numel, i) for i, x in enumerate(t) if not x.local]
    assert remote[-1] == (512, 28) and [i for n, i in remote if n == 1024] == [23, 24]
    assert list(dropped_transfer(plan).transfers) == t[:24] + t[25:]


# -- stages_publish_local_indices


def test_stages_publish_local_indices_moves_a_later_stages_layers_onto_layer_0():
    plan = _plan(tiny(2, n_layers=2), "megatron:tp=2,pp=2", "vllm:2")
    t = list(plan.transfers)
    later = [i for i, x in enumerate(t) if x.param.startswith("layers.1.")]
    assert later == list(range(20, 42))
    assert all("model.layers.1." in t[i].dst_name for i in later)
    mutated = stages_publish_local_indices(plan)
    assert mutated.mutation == "stages_publish_local_indices"
    assert list(mutated.transfers) == t[:20] + [
        replace(x, dst_name=x.dst_name.replace("model.layers.1.", "model.layers.0."))
        for x in t[20:42]] + t[42:]
    head = mutated.writes()[0]
    assert head == "12 destination tensors written twice, 12 with elements never written"


def test_stages_publish_local_indices_names_what_it_cannot_misread():
    plan = _plan(tiny(2, n_layers=2), "megatron:tp=2,pp=2", "vllm:2")
    # only the first stage's transfers: nothing published under another index
    first = plan.with_transfers([x for x in plan.transfers if not x.param.startswith("layers.1.")],
                                "first stage")
    assert _not_applicable(stages_publish_local_indices, first) == \
        "megatron:tp=2,pp=2: every stage's layers start at global layer 0"
    def without(rank, name):
        """``plan`` with destination ``rank`` holding no ``name``."""
        pieces = [dict(p) for p in plan.dst.pieces]
        del pieces[rank][name]
        return replace(plan, dst=replace(plan.dst, pieces=tuple(pieces)))

    # a destination rank 0 without layer 0's input norm: the later stage's has nowhere to land
    lacking = without(0, "model.layers.0.input_layernorm.weight")
    assert _not_applicable(stages_publish_local_indices, lacking) == (
        "vllm:2 rank 0 model.layers.1.input_layernorm.weight: no layer index in its name to "
        "misread")
    # the twin: with rank 1's norm gone instead, rank 0's transfers come first and move
    later = without(1, "model.layers.0.self_attn.o_proj.weight")
    assert _not_applicable(stages_publish_local_indices, later) == (
        "vllm:2 rank 1 model.layers.1.self_attn.o_proj.weight: no layer index in its name to "
        "misread")


@pytest.mark.parametrize("dst", ["megatron:tp=1,pp=2", "megatron:tp=2,pp=2"])
def test_a_destination_named_by_local_indices_has_no_global_index_to_misread(dst):
    # a staged Megatron destination names each stage's layers from 0: the rename finds no
    # global index in them; it once counted them moved and handed back the plan unchanged
    plan = _plan(tiny(2, n_layers=2), "megatron:tp=2,pp=2", dst)
    assert any(x.param.startswith("layers.1.") and "decoder.layers.0." in x.dst_name
               for x in plan.transfers)
    assert _not_applicable(stages_publish_local_indices, plan) == (
        f"{dst} names its layers by their stage's local index: no global index to publish as "
        "a local one")
    # the twin: one stage at the destination, global names, the layers moved
    single = _plan(tiny(2, n_layers=2), "megatron:tp=2,pp=2", "megatron:tp=2")
    assert stages_publish_local_indices(single).writes() != ()


def test_where_a_staged_destination_holds_some_layers_globally_only_those_move():
    # four stages of one layer into two of two: layer 1 lands on the destination's first
    # stage, which names it 1, and is published as 0; layers 2 and 3 land on its second
    # stage, named 0 and 1 there: no global index in the name, kept where they were
    plan = _plan(tiny(2, n_layers=4), "megatron:tp=1,pp=4", "megatron:tp=1,pp=2")
    mutated = stages_publish_local_indices(plan)
    assert list(mutated.transfers) == [
        replace(x, dst_name=x.dst_name.replace("decoder.layers.1.", "decoder.layers.0."))
        if x.param.startswith("layers.1.") else x for x in plan.transfers]
    assert any(x.param.startswith("layers.3.") for x in mutated.transfers)


def test_stages_publish_local_indices_rewrites_the_first_layer_index_of_a_name_only():
    plan = _plan(tiny(2, n_layers=2), "megatron:tp=2,pp=2", "vllm:2")
    norm = "model.layers.1.input_layernorm.weight"
    i, t = next((i, x) for i, x in enumerate(plan.transfers) if x.dst_name == norm)
    twice, once = f"{norm}.layers.1.x", "model.layers.0.input_layernorm.weight.layers.1.x"
    pieces = [dict(p) for p in plan.dst.pieces]
    pieces[t.dst_rank][twice] = pieces[t.dst_rank][once] = pieces[t.dst_rank][norm]
    odd = replace(plan, dst=replace(plan.dst, pieces=tuple(pieces)),
                  transfers=plan.transfers[:i] + (replace(t, dst_name=twice),)
                  + plan.transfers[i + 1:])
    assert stages_publish_local_indices(odd).transfers[i] == replace(t, dst_name=once)


# -- experts_swapped


def test_experts_swapped_exchanges_rank_0s_first_two_experts_of_layer_0():
    plan = _plan(MOE, "megatron:tp=2,ep=2", "vllm:tp=2,ep=2")
    t = list(plan.transfers)
    into = {i: x.dst_name for i, x in enumerate(t) if x.dst_rank == 0 and "w13" in x.dst_name}
    assert into == {i: f"{W13}[{(i - 22) // 4}]" for i in range(22, 30)}
    mutated = experts_swapped(plan)
    assert mutated.mutation == "experts_swapped"
    assert list(mutated.transfers) == t[:22] + [
        replace(x, dst_name=f"{W13}[{1 - (i - 22) // 4}]") for i, x in enumerate(t[22:30], 22)
    ] + t[30:]
    assert mutated.writes() == ()
    # rank 1 holds the same names (its halves of the same experts): untouched
    assert [x for x in mutated.transfers if x.dst_rank != 0] == \
        [x for x in plan.transfers if x.dst_rank != 0]
    # what rank 1 holds is not read: with nothing there, the same swap
    pieces = (plan.dst.pieces[0], {}) + plan.dst.pieces[2:]
    lonely = replace(plan, dst=replace(plan.dst, pieces=pieces))
    assert experts_swapped(lonely).transfers == mutated.transfers


def test_experts_swapped_pairs_the_same_rows_of_another_expert_not_another_part_of_one():
    # HF stores each expert's gate_proj and up_proj apart: expert 0's gate rows pair with
    # expert 1's gate rows, not with expert 0's up rows (another expert, the same rows)
    plan = _plan(MOE, "megatron:tp=2,ep=2", "hf")
    gate = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    held = [n for n, p in plan.dst.parts[0].items()
            if p.source == "layers.0.experts.gate_up.weight"]
    assert held[:3] == [gate.format(0), gate.format(0).replace("gate", "up"), gate.format(1)]
    swap = {gate.format(0): gate.format(1), gate.format(1): gate.format(0)}
    assert list(experts_swapped(plan).transfers) == [
        replace(x, dst_name=swap.get(x.dst_name, x.dst_name)) for x in plan.transfers]
    # one gate row and one up row per expert (expert_ffn 1): members of one row
    single = _plan(tiny(4, n_experts=4, top_k=2, expert_ffn=1), "plain:1", "hf")
    assert all(single.dst.parts[0][n].idx.numel() == 1 for n in swap)
    assert list(experts_swapped(single).transfers) == [
        replace(x, dst_name=swap.get(x.dst_name, x.dst_name)) for x in single.transfers]


def test_experts_swapped_on_a_rank_0_holding_later_experts_from_the_middle_of_their_rows():
    # rank 0 made to hold rows 8-23 of experts 2 and 3 (another rank's share of them)
    plan = _plan(MOE, "megatron:tp=2,ep=2", "hf")
    gate = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    pieces = [dict(p) for p in plan.dst.pieces]
    for e in range(4):
        for part in ("gate", "up"):
            del pieces[0][gate.format(e).replace("gate", part)]
    for e, start in ((0, 72), (1, 104)):
        pieces[0][gate.format(e)] = Piece("layers.0.experts.gate_up.weight", 0,
                                          torch.arange(start, start + 16))
    later = replace(plan, dst=replace(plan.dst, pieces=tuple(pieces)))
    swap = {gate.format(0): gate.format(1), gate.format(1): gate.format(0)}
    assert list(experts_swapped(later).transfers) == [
        replace(x, dst_name=swap.get(x.dst_name, x.dst_name)) if x.dst_rank == 0 else x
        for x in plan.transfers]


# -- what has nothing to break


def test_each_mutation_names_what_the_plan_lacks():
    m4_v2, fsdp = _m4_v2(), _plan(tiny(4), "megatron:2", "fsdp:2")
    moe = _plan(MOE, "megatron:tp=2,ep=2", "vllm:tp=2,ep=2")
    assert _not_applicable(qk_swapped, fsdp) == \
        "fsdp:2 rank 0 layers.0.qkv.weight holds no whole Q and K head in one run"
    assert _not_applicable(qk_swapped, _plan(tiny(4), "plain:1", "meta:2")) == \
        "meta:2 rank 0 layers.0.attention.wq.weight holds no whole Q and K head in one run"
    assert _not_applicable(gate_up_swapped, fsdp) == \
        "fsdp:2 rank 0 layers.0.gate_up.weight does not hold both gate and up rows"
    assert _not_applicable(gate_up_swapped, _plan(tiny(4), "plain:1", "meta:2")) == \
        "meta:2 rank 0 layers.0.feed_forward.w1.weight does not hold both gate and up rows"
    assert _not_applicable(gate_up_swapped, moe) == \
        "vllm:tp=2,ep=2 rank 0 stores no tensor of a layers.0.gate_up.weight"
    assert _not_applicable(kv_replica_off_by_one, m4_v2) == \
        "vllm:2 replicates no KV head (HP(8,4,8))"
    assert _not_applicable(kv_replica_off_by_one, fsdp) == "fsdp:2 replicates no KV head (S(0))"
    assert _not_applicable(kv_replica_off_by_one, _plan(tiny(1), "megatron:1", "vllm:4")) == \
        "vllm:4: every rank holds the same KV head"
    assert _not_applicable(dst_ranks_swapped, _plan(tiny(4), "vllm:2", "vllm:1")) == \
        "vllm:1 has one destination rank"
    assert _not_applicable(box_overlap, _plan(tiny(2), "megatron:2", "vllm:4")) == \
        "megatron:2 -> vllm:4: no remote transfer borders a local copy"
    assert _not_applicable(dropped_transfer, _plan(tiny(2), "megatron:2", "vllm:2")) == \
        "megatron:2 -> vllm:2: no transfer between ranks to drop"
    assert _not_applicable(stages_publish_local_indices, m4_v2) == \
        "megatron:4 has no pipeline stages"
    assert _not_applicable(stages_publish_local_indices,
                           _plan(tiny(4), "fsdp:4", "plain:2")) == "fsdp:4 has no pipeline stages"
    # staged (the embedding counted as a layer) but one pipeline stage
    one_stage = _plan(tiny(2, n_layers=2), "megatron:tp=1,pp=1,pp_account=embedding", "vllm:1")
    assert one_stage.src.at.staged and one_stage.src.at.pp == 1
    assert _not_applicable(stages_publish_local_indices, one_stage) == \
        "megatron:pp_account=embedding has no pipeline stages"
    assert _not_applicable(experts_swapped, m4_v2) == "tiny_kv4 has no experts"
    assert _not_applicable(experts_swapped, _plan(MOE, "megatron:tp=2,ep=2", "vllm:tp=4,ep=4")) \
        == "vllm:tp=4,ep=4 rank 0 holds one expert of layer 0"


def test_the_catalogue_names_each_mutation_and_calls_it():
    assert list(PLAN_MUTATIONS) == [
        "qk_swapped", "gate_up_swapped", "kv_replica_off_by_one", "dst_ranks_swapped",
        "box_overlap", "dropped_transfer", "stages_publish_local_indices", "experts_swapped"]
    assert all(m.name == name for name, m in PLAN_MUTATIONS.items())
    plan = _m4_v2()
    seen = []
    probe = PlanMutation("probe", lambda p: seen.append(p) or p)
    assert probe(plan) is plan and seen == [plan]
