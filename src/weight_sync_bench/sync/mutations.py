"""Planner mutations: the bugs a resharding planner makes, applied to a correct plan.

Each takes a ``Plan`` and returns a wrong one (the destination layout it claims stays the
declared one), or raises ``NotApplicable`` where the plan has nothing it could break (no
replicated KV head, no remote transfer...). Each must be caught by the element check and by
the forward (``tests/sync/test_mutations.py``, against the twin: the unmutated plan passes).

- ``qk_swapped``: destination rank 0 gets its first K head where its first Q head goes,
  and the Q head in the K head's place (a planner that mixed up the fused ranges);
- ``gate_up_swapped``: rank 0's gate rows and up rows exchanged in the fused gate_up;
- ``kv_replica_off_by_one``: a replicated KV head fetched for the wrong replica: the first
  rank ``r`` whose neighbour holds another head gets head ``kv_head(r + 1)``;
- ``dst_ranks_swapped``: everything meant for destination rank 0 lands on rank 1 and the
  reverse (the ranks of one TP group in the wrong order);
- ``box_overlap``: one transfer one index longer than its box, so it also writes the first
  index of a neighbouring box (one a local copy wrote before it);
- ``dropped_transfer``: the largest transfer between ranks left out;
- ``stages_publish_local_indices``: a pipeline source's later stages write their layers into
  the destination layers of their local indices (two stages claiming one layer, the layers
  past the first stage never written);
- ``experts_swapped``: two of destination rank 0's layer-0 experts exchanged (what is meant
  for one expert's tensor, or one member of vLLM's stacked ``w13_weight``, written into
  another's: a local-to-global expert index mixed up).

Besides the element check and the forward, ``Plan.writes`` names where a plan writes a
destination element twice or never, from its transfers alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from weight_sync_bench.conventions.maps import Piece
from weight_sync_bench.errors import WsbError
from weight_sync_bench.layout.placements import HeadReplicated
from weight_sync_bench.sync.boxes import cover_of
from weight_sync_bench.sync.planner import Plan, Transfer, build_plan


class NotApplicable(WsbError, ValueError):
    """The plan has nothing this mutation could break; the message says what is missing."""


@dataclass(frozen=True)
class PlanMutation:
    name: str
    apply: Callable[[Plan], Plan]

    def __call__(self, plan: Plan) -> Plan:
        return self.apply(plan)


# -- moving parts of a plan


def _split(t: Transfer, dim: int, at: int) -> list[Transfer]:
    """``t`` cut where its destination position along ``dim`` reaches ``at``."""
    (a, b), start = t.region[dim], t.dst_at[dim]
    cut = a + at - start
    if not a < cut < b:
        return [t]
    return [_narrow(t, dim, a, cut), _narrow(t, dim, cut, b)]


def _narrow(t: Transfer, dim: int, a: int, b: int) -> Transfer:
    region = list(t.region)
    shift = a - region[dim][0]
    region[dim] = (a, b)
    src_at, dst_at = list(t.src_at), list(t.dst_at)
    src_at[dim] += shift
    dst_at[dim] += shift
    return replace(t, region=tuple(region), src_at=tuple(src_at), dst_at=tuple(dst_at))


def _moved(t: Transfer, dim: int, delta: int) -> Transfer:
    dst_at = list(t.dst_at)
    dst_at[dim] += delta
    return replace(t, dst_at=tuple(dst_at))


def swap_positions(plan: Plan, rank: int, name: str, dim: int, a: int, b: int, length: int,
                   mutation: str) -> Plan:
    """What the plan writes into positions ``[a, a + length)`` of ``rank``'s ``name`` along
    ``dim`` goes to ``[b, b + length)`` instead, and the reverse."""
    out = []
    for t in plan.transfers:
        if t.dst_rank != rank or t.dst_name != name:
            out.append(t)
            continue
        parts = [t]
        for cut in (a, a + length, b, b + length):
            parts = [q for p in parts for q in _split(p, dim, cut)]
        for p in parts:
            pos = p.dst_at[dim]
            if a <= pos < a + length:
                p = _moved(p, dim, b - a)
            elif b <= pos < b + length:
                p = _moved(p, dim, a - b)
            out.append(p)
    return plan.with_transfers(out, mutation)


def _stored_of(plan: Plan, rank: int, suffix: str) -> tuple[str, Piece]:
    for name, piece in plan.dst.parts[rank].items():
        if piece.source.endswith(suffix):
            return name, piece
    raise NotApplicable(f"{plan.dst} rank {rank} stores no tensor of a {suffix}")


def _first_run(piece: Piece, lo: int, hi: int) -> tuple[int, int]:
    """(position, length) of the first run of positions holding canonical [lo, hi)."""
    inside = ((piece.idx >= lo) & (piece.idx < hi)).nonzero().flatten().tolist()
    if not inside:
        return -1, 0
    n = 1
    while n < len(inside) and inside[n] == inside[0] + n:
        n += 1
    return inside[0], n


# -- the mutations


def qk_swapped(plan: Plan) -> Plan:
    config = plan.dst.config
    name, piece = _stored_of(plan, 0, "layers.0.qkv.weight")
    hd = config.head_dim
    q, n_q = _first_run(piece, 0, config.q_rows)
    k, n_k = _first_run(piece, config.q_rows, config.q_rows + config.kv_rows)
    if min(n_q, n_k) < hd:
        raise NotApplicable(f"{plan.dst} rank 0 {name} holds no whole Q and K head in one run")
    return swap_positions(plan, 0, name, piece.dim, q, k, hd, "qk_swapped")


def gate_up_swapped(plan: Plan) -> Plan:
    config = plan.dst.config
    name, piece = _stored_of(plan, 0, "layers.0.gate_up.weight")
    g, n_g = _first_run(piece, 0, config.ffn)
    u, n_u = _first_run(piece, config.ffn, 2 * config.ffn)
    if min(n_g, n_u) == 0:
        raise NotApplicable(f"{plan.dst} rank 0 {name} does not hold both gate and up rows")
    return swap_positions(plan, 0, name, piece.dim, g, u, min(n_g, n_u), "gate_up_swapped")


def kv_replica_off_by_one(plan: Plan) -> Plan:
    dst = plan.dst
    placement = dst.statement["layers.0.qkv.weight"].placement
    if not isinstance(placement, HeadReplicated):
        raise NotApplicable(f"{dst} replicates no KV head ({placement})")
    config, t = dst.config, dst.degree
    rank = next((r for r in range(t - 1)
                 if placement.kv_head(t, r + 1) != placement.kv_head(t, r)), None)
    if rank is None:
        raise NotApplicable(f"{dst}: every rank holds the same KV head")
    name, piece = _stored_of(plan, rank, "layers.0.qkv.weight")
    shift = (placement.kv_head(t, rank + 1) - placement.kv_head(t, rank)) * config.head_dim
    idx = piece.idx.clone()
    kv = (idx >= config.q_rows)
    idx[kv] += shift  # K_g -> K_g', V_g -> V_g': the other replica's head
    wrong = [dict(p) for p in dst.pieces]
    wrong[rank][name] = Piece(piece.source, piece.dim, idx)
    broken = replace(dst, label=f"{dst.label} (rank {rank} KV head off by one)",
                     pieces=tuple(wrong))
    replanned = build_plan(cover_of(plan.src), cover_of(broken, validate=False))
    keep = [x for x in plan.transfers if (x.dst_rank, x.dst_name) != (rank, name)]
    new = [x for x in replanned.transfers if (x.dst_rank, x.dst_name) == (rank, name)]
    return plan.with_transfers(keep + new, "kv_replica_off_by_one")


def dst_ranks_swapped(plan: Plan) -> Plan:
    if plan.dst.world < 2:
        raise NotApplicable(f"{plan.dst} has one destination rank")
    swap = {0: 1, 1: 0}
    return plan.with_transfers([replace(t, dst_rank=swap.get(t.dst_rank, t.dst_rank))
                                for t in plan.transfers], "dst_ranks_swapped")


def box_overlap(plan: Plan) -> Plan:
    """The first remote transfer that, one index longer (forward, else backward) along its
    destination box's dim, writes a position a local copy filled, with a source index that
    is not the one declared there."""
    written = {}  # (rank, name, dim position) of local copies, per destination dim
    for t in plan.transfers:
        if t.local:
            dim = plan.dst.parts[t.dst_rank][t.dst_name].dim
            (a, b) = t.region[dim]
            for p in range(t.dst_at[dim], t.dst_at[dim] + b - a):
                written[(t.dst_rank, t.dst_name, p)] = True
    for index, t in enumerate(plan.transfers):
        if t.local:
            continue
        dst_piece = plan.dst.parts[t.dst_rank][t.dst_name]
        src_piece = plan.src.parts[t.src_rank][t.src_name]
        dim = dst_piece.dim
        if src_piece.dim != dim:
            continue
        (a, b) = t.region[dim]
        for step in (1, -1):
            d_pos = t.dst_at[dim] + (b - a) if step == 1 else t.dst_at[dim] - 1
            s_pos = t.src_at[dim] + (b - a) if step == 1 else t.src_at[dim] - 1
            if not (0 <= d_pos < dst_piece.idx.numel() and 0 <= s_pos < src_piece.idx.numel()):
                continue
            if not written.get((t.dst_rank, t.dst_name, d_pos)):
                continue
            if int(src_piece.idx[s_pos]) == int(dst_piece.idx[d_pos]):
                continue
            region = list(t.region)
            src_at, dst_at = list(t.src_at), list(t.dst_at)
            if step == 1:
                region[dim] = (a, b + 1)
            else:
                region[dim] = (a - 1, b)
                src_at[dim] -= 1
                dst_at[dim] -= 1
            longer = replace(t, region=tuple(region), src_at=tuple(src_at), dst_at=tuple(dst_at))
            out = list(plan.transfers)
            out[index] = longer
            return plan.with_transfers(out, "box_overlap")
    raise NotApplicable(f"{plan.label}: no remote transfer borders a local copy")


def dropped_transfer(plan: Plan) -> Plan:
    remote = [(t.numel, i) for i, t in enumerate(plan.transfers) if not t.local]
    if not remote:
        raise NotApplicable(f"{plan.label}: no transfer between ranks to drop")
    _, drop = max(remote)
    return plan.with_transfers([t for i, t in enumerate(plan.transfers) if i != drop],
                               "dropped_transfer")


def stages_publish_local_indices(plan: Plan) -> Plan:
    """Every pipeline stage publishes its layers under their local indices: what a later
    stage sends for its global layer l lands in the destination's layer ``l - offset``,
    which the first stage writes too, and layer l is never written (NVIDIA-NeMo/RL PR
    #3259: 51% of the weights synced, digests agreeing)."""
    at = plan.src.at
    if at is None or not at.staged or at.pp == 1:
        raise NotApplicable(f"{plan.src} has no pipeline stages")
    config = plan.src.config
    start = {layer: chunk.start for stage in at.pipeline.chunks(config.n_layers)
             for chunk in stage for layer in chunk}
    out, moved, kept_local = [], 0, 0
    for t in plan.transfers:
        parts = t.param.split(".")
        local = int(parts[1]) - start[int(parts[1])] if parts[0] == "layers" else None
        if local is None or local == int(parts[1]):
            out.append(t)
            continue
        name = t.dst_name.replace(f"layers.{parts[1]}.", f"layers.{local}.", 1)
        if name == t.dst_name:  # a staged destination names it by its own stage's index
            out.append(t)
            kept_local += 1
            continue
        if name not in plan.dst.parts[t.dst_rank]:
            raise NotApplicable(f"{plan.dst} rank {t.dst_rank} {t.dst_name}: no layer index "
                                "in its name to misread")
        out.append(replace(t, dst_name=name))
        moved += 1
    if not moved and kept_local:
        raise NotApplicable(f"{plan.dst} names its layers by their stage's local index: no "
                            "global index to publish as a local one")
    if not moved:
        raise NotApplicable(f"{plan.src}: every stage's layers start at global layer 0")
    return plan.with_transfers(out, "stages_publish_local_indices")


def experts_swapped(plan: Plan) -> Plan:
    """What the plan writes into destination rank 0's first expert tensor of layer 0 (a
    stored tensor, or a member of a stacked one: vLLM's ``w13_weight[i]``) lands in the
    first tensor of another expert that holds the same rows of its expert, and the reverse:
    a local-to-global expert index mixed up (two experts' weights exchanged, every byte
    written once)."""
    config = plan.dst.config
    if not config.n_experts:
        raise NotApplicable(f"{config.name} has no experts")
    per = 2 * config.expert_ffn  # an expert's [gate | up] rows in the canonical gate_up
    held = [(name, piece) for name, piece in plan.dst.parts[0].items()
            if piece.source == "layers.0.experts.gate_up.weight" and piece.idx.numel()]
    for name, piece in held:
        first = int(piece.idx[0])
        other = next((n for n, p in held if p.idx.numel() == piece.idx.numel()
                      and int(p.idx[0]) // per != first // per
                      and int(p.idx[0]) % per == first % per), None)
        if other is not None:
            swap = {name: other, other: name}
            return plan.with_transfers(
                [replace(t, dst_name=swap[t.dst_name]) if t.dst_rank == 0
                 and t.dst_name in swap else t for t in plan.transfers], "experts_swapped")
    raise NotApplicable(f"{plan.dst} rank 0 holds one expert of layer 0")


PLAN_MUTATIONS: dict[str, PlanMutation] = {m.name: m for m in (
    PlanMutation("qk_swapped", qk_swapped),
    PlanMutation("gate_up_swapped", gate_up_swapped),
    PlanMutation("kv_replica_off_by_one", kv_replica_off_by_one),
    PlanMutation("dst_ranks_swapped", dst_ranks_swapped),
    PlanMutation("box_overlap", box_overlap),
    PlanMutation("dropped_transfer", dropped_transfer),
    PlanMutation("stages_publish_local_indices", stages_publish_local_indices),
    PlanMutation("experts_swapped", experts_swapped),
)}

__all__ = ["PLAN_MUTATIONS", "NotApplicable", "PlanMutation", "swap_positions"]
