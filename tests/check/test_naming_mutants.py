"""``check.naming`` read at its seams (issue 30, the mutation pass over ``check/naming.py``):
what each catalogue holds (never a mutation that is the identity there), what each candidate
may touch and what it means, the comparison of a candidate's tensors with the observed ones,
and ``observe_redrawn``: a streamed check's second look at the parameters it compared equal
before the first difference, drawn again in the check's dtype, only those a candidate still
alive touches, stopping once none is left to draw."""

from __future__ import annotations

import torch

from weight_sync_bench import TOY, layout_for
from weight_sync_bench.check import naming
from weight_sync_bench.check.mutations import DTYPE_MUTATIONS, MUTATIONS
from weight_sync_bench.check.naming import (
    Candidate,
    Naming,
    conversion_naming,
    layout_naming,
    observe_redrawn,
    same,
)
from weight_sync_bench.conventions import endpoint, shards_for
from weight_sync_bench.conventions.mutations import Conversion
from weight_sync_bench.model.config import init_params

LAYOUT = layout_for(TOY)
BF16_ROUND_TRIP = next(m for m in DTYPE_MUTATIONS if m.name == "bf16_round_trip")


def names(catalogue: Naming) -> set[str]:
    return {c.name for c in catalogue.alive}


def test_the_layout_catalogue_holds_no_mutation_that_is_the_identity_there():
    t1_bf16 = names(layout_naming(TOY, LAYOUT, 1, torch.bfloat16))
    t2_fp32 = names(layout_naming(TOY, LAYOUT, 2, torch.float32))
    assert "embedding_reversed" not in t1_bf16 and "bf16_round_trip" not in t1_bf16
    assert {"embedding_reversed", "bf16_round_trip"} <= t2_fp32  # the twin
    for degree, dtype, found in ((1, torch.bfloat16, t1_bf16), (2, torch.float32, t2_fp32)):
        assert found == {m.name for m in (*MUTATIONS.values(), *DTYPE_MUTATIONS)
                         if m.identity_reason(TOY, degree, dtype) is None}


def test_a_layout_candidate_touches_only_its_target_and_means_its_description():
    [kv] = [c for c in layout_naming(TOY, LAYOUT, 2, torch.float32).alive
            if c.name == "kv_swapped"]
    assert kv.touches("layers.0.qkv.weight") and not kv.touches("tok_embeddings.weight")
    assert kv.meaning == MUTATIONS["kv_swapped"].description


def test_a_conversion_candidate_touches_what_it_changes_and_a_round_trip_means_itself():
    conversion = Conversion(TOY, endpoint("megatron:2"), endpoint("vllm:2"))
    declared = shards_for(TOY, "vllm:2")
    catalogue = conversion_naming(conversion, declared, torch.float32)
    [fc1] = [c for c in catalogue.alive if c.name == "megatron_fc1_rank_concat"]
    assert fc1.touches("model.layers.0.mlp.gate_up_proj.weight")
    assert not fc1.touches("model.embed_tokens.weight")
    [trip] = [c for c in catalogue.alive if c.name == "bf16_round_trip"]
    assert trip.meaning == BF16_ROUND_TRIP.description
    assert naming.Named((trip.name,), (trip.meaning,)).meaning == BF16_ROUND_TRIP.description


def test_tensors_are_the_same_only_rank_for_rank():
    a, b = torch.zeros(2), torch.ones(2)
    assert same([a, b], [a.clone(), b.clone()]) and not same([a, b], [a, a])
    assert not same([a, b], [a]) and not same([a], [a, b])  # not a prefix, and no error


# ---- observe_redrawn, with candidates made here ----

def changes(*targets):
    """A candidate that doubles ``targets`` and touches nothing else."""
    def mutated(name, declared):
        return [x * 2 for x in declared] if name in targets else declared
    return Candidate("changes " + ", ".join(targets), "", mutated, lambda n: n in targets)


def leaves_alone(name="nothing"):
    return Candidate(name, "", lambda n, declared: declared, lambda n: False)


def redrawn(candidates, before, weights=torch.float32, drawn=None):
    catalogue = Naming(list(candidates))
    observe_redrawn(catalogue, before, TOY, LAYOUT, 2, 0, weights)
    return names(catalogue)


EMBED, NORM0, QKV1 = "tok_embeddings.weight", "layers.0.attn_norm.weight", "layers.1.qkv.weight"


def test_a_candidate_that_changes_a_parameter_found_equal_is_dropped_and_the_others_kept():
    kept = redrawn([changes(QKV1), leaves_alone()], [EMBED, NORM0, QKV1])
    assert kept == {"nothing"}
    # the twin: a parameter it changes that was not found equal before is not held against it
    assert redrawn([changes(QKV1), leaves_alone()], [EMBED, NORM0]) == {
        "changes layers.1.qkv.weight", "nothing"}


def test_every_touched_parameter_is_looked_at_not_only_the_first():
    assert redrawn([changes(EMBED, QKV1)], [EMBED, QKV1]) == set()
    # only the later one changed: still dropped
    def later_only(name, declared):
        return [x * 2 for x in declared] if name == QKV1 else declared
    late = Candidate("late", "", later_only, lambda n: n in (NORM0, QKV1))
    assert redrawn([late], [NORM0, QKV1]) == set()


def test_the_parameters_are_drawn_again_in_the_checks_dtype():
    """A bf16 round trip of bf16 weights is exactly the weights: drawn in bf16, it agrees;
    drawn in fp32 it would not."""
    trip = Candidate("trip", "", lambda n, declared: BF16_ROUND_TRIP.bug(list(declared), None,
                                                                        TOY))
    assert redrawn([trip], [EMBED], weights=torch.bfloat16) == {"trip"}
    assert redrawn([trip], [EMBED], weights=torch.float32) == set()  # the twin


def test_drawing_stops_after_the_last_touched_parameter(monkeypatch):
    drawn = []
    original = naming.iter_params

    def counted(config, seed, dtype=torch.float32):
        for name, x in original(config, seed, dtype=dtype):
            drawn.append(name)
            yield name, x
    monkeypatch.setattr(naming, "iter_params", counted)
    order = list(init_params(TOY, 0))
    assert redrawn([changes(NORM0), leaves_alone()], [EMBED, NORM0]) == {"nothing"}
    assert drawn == order[:order.index(NORM0) + 1]
    drawn.clear()  # nothing alive touches anything: nothing drawn
    assert redrawn([leaves_alone()], [EMBED, NORM0]) == {"nothing"} and drawn == []


def test_a_conversion_to_the_plain_layout_holds_its_layout_mutations_not_the_identities():
    def catalogue(dst):
        conversion = Conversion(TOY, endpoint("megatron:1"), endpoint(dst))
        return names(conversion_naming(conversion, shards_for(TOY, dst), torch.float32,
                                       LAYOUT))
    assert "embedding_reversed" not in catalogue("plain:1")  # reversed ranks: one rank
    assert "embedding_reversed" in catalogue("plain:2")  # the twin
