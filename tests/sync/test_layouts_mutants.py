"""What a sync layout states each rank holds, against what its maps hold (issue 30, the
mutation pass over ``sync/layouts.py``).

A layout states its ranks' canonical ranges in the harness's placement vocabulary
(``SyncLayout.stated_ranges``, from its ``statement``), independently of the convention's
index maps (``pieces``), so ``boxes.validate_cover`` can check one against the other. Here
the two are compared element by element, on every rank of every canonical parameter,
across the cases ``stated_ranges`` tells apart: Megatron's qkv stored as raw rows the
forward gathers (TP above the KV heads), pipeline stages (a stage holds only its layers,
the tied embedding its last stage's copy), expert parallelism, data-parallel replicas of
all of these, a vocabulary the convention pads (the statement clipped to the canonical
shape), FSDP and HF. Stated and held are equal sets: a statement wider than the maps would
let a missing tensor pass the cover check, a narrower one would refuse a right layout.
"""

from __future__ import annotations

import pytest

from tests.sync.conftest import MOE_FEW, tiny
from weight_sync_bench.sync import sync_layout
from weight_sync_bench.sync.layouts import fsdp_table

DENSE = tiny(2, n_layers=4)


def held(layout, rank: int, name: str, dim: int) -> set[int]:
    """The canonical indices along ``dim`` of ``name`` that ``rank``'s maps hold (padding
    left out)."""
    out: set[int] = set()
    for piece in layout.pieces[rank].values():
        if piece.source == name:
            assert piece.dim == dim, (name, rank, piece.dim, dim)
            out |= {int(i) for i in piece.idx.tolist() if i >= 0}
    return out


CASES = [
    (DENSE, "megatron:4", 1),  # t = 4 > 2 KV heads: qkv stored as raw rows, gathered
    (DENSE, "megatron:4", 2),
    (DENSE, "megatron:2", 2),
    (DENSE.replace(vocab=250), "megatron:4", 1),  # a padded vocabulary: clipped
    (DENSE.replace(vocab=250), "vllm:2", 2),
    (DENSE, "vllm:2", 1),
    (DENSE, "vllm:4", 2),
    (DENSE, "megatron:tp=2,pp=2", 1),
    (DENSE, "megatron:tp=4,pp=2", 2),  # staged, and qkv gathered
    (DENSE, "megatron:tp=1,pp=2,vpp=2", 2),
    (DENSE.replace(tie_embeddings=True), "megatron:tp=2,pp=2", 1),
    (DENSE, "fsdp:4", 1),
    (DENSE, "fsdp:2", 2),
    (DENSE, "hf", 1),
    (DENSE, "plain:2", 1),
    (MOE_FEW, "megatron:tp=2,ep=2", 1),
    (MOE_FEW, "vllm:tp=2,ep=2", 2),
    (MOE_FEW, "megatron:tp=2,pp=2,ep=2", 1),
]


@pytest.mark.parametrize(("config", "text", "dp"), CASES,
                         ids=[f"{c.name}-v{c.vocab}-{t}-dp{d}" for c, t, d in CASES])
def test_every_rank_is_stated_to_hold_exactly_what_its_maps_hold(config, text, dp):
    layout = sync_layout(config, text, dp=dp)
    shapes = config.param_shapes()
    for rank in range(layout.world):
        for name, shape in shapes.items():
            dim, ranges = layout.stated_ranges(name, rank)
            assert all(0 <= a < b <= shape[dim] for a, b in ranges), (name, rank, ranges)
            stated = {i for a, b in ranges for i in range(a, b)}
            assert stated == held(layout, rank, name, dim), (text, dp, rank, name)


def test_replicas_state_what_their_tp_rank_states():
    layout = sync_layout(DENSE, "megatron:tp=2,pp=2", dp=2)
    assert layout.world == 8 and layout.replica == 4
    for rank in range(4, 8):
        for name in DENSE.param_shapes():
            assert layout.stated_ranges(name, rank) == layout.stated_ranges(name, rank - 4)
    plain = sync_layout(DENSE, "vllm:2", dp=2)
    assert [plain.tp_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_fsdp_states_shard_0_of_every_parameter():
    table = fsdp_table(DENSE)
    assert [s.name for s in table] == list(DENSE.param_shapes())
    layout = sync_layout(DENSE, "fsdp:4")
    assert layout.convention is None and layout.at is None and not layout.runs_forward
    rows = DENSE.vocab // 4
    assert [layout.stated_ranges("tok_embeddings.weight", r) for r in range(4)] == [
        (0, [(r * rows, (r + 1) * rows)]) for r in range(4)]


def test_one_replica_by_default():
    assert sync_layout(DENSE, "vllm:2").world == 2 and sync_layout(DENSE, "vllm:2").dp == 1


def test_a_stacked_tensor_is_planned_and_addressed_member_by_member():
    """vLLM's fused-MoE ``w13_weight`` ``[E_local, 2F/t, d]``: phase 2 plans each local
    expert's rows as a part of its own (``parts``, ``{name}[{i}]``), and ``members`` gives the
    views that write the stored tensor; a tensor not stacked is itself."""
    import torch

    layout = sync_layout(MOE_FEW, "vllm:tp=2,ep=2")
    rank = 1
    stored = layout.pieces[rank]
    stacked = [n for n, p in stored.items() if p.is_stacked]
    plain = [n for n, p in stored.items() if not p.is_stacked]
    assert stacked and plain
    want_parts = set(plain) | {f"{n}[{i}]" for n in stacked for i in range(stored[n].stack)}
    assert set(layout.parts[rank]) == want_parts
    for n in stacked:
        for i, member in enumerate(stored[n].members()):
            assert torch.equal(layout.parts[rank][f"{n}[{i}]"].idx, member.idx)
    tensors = {n: torch.zeros(3, 2) if not stored[n].is_stacked else
               torch.zeros(stored[n].stack, 2) for n in stored}
    del tensors[plain[0]]  # a name the tensors lack is left out
    out = layout.members(rank, tensors)
    assert set(out) == want_parts - {plain[0]}
    assert all(out[n] is tensors[n] for n in plain[1:])
    n = stacked[0]
    out[f"{n}[1]"].fill_(7.0)  # a view: writing it writes the stored tensor
    assert bool((tensors[n][1] == 7.0).all()) and bool((tensors[n][0] == 0.0).all())
    assert layout.members(layout.world, tensors) == {}
