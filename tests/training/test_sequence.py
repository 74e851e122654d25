"""Sequence and context parallelism: the sharded step on TP x SP, CP and CP x TP meshes
against the dense reference, with the thresholds of the committed tolerance/sequence.json;
global shapes, local offsets, the ranks each collective spans and the count of each kind
per forward and backward; uneven splits rejected by rule; every sequence mutation detected
where it is not the identity, beside its unmutated twin."""

from dataclasses import replace

import pytest
import torch

from tests.breadth import breadth
from weight_sync_bench.errors import UnevenSequence
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import TOY, TOY_KV4, init_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import attend, context_mask, document_mask
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.rules import derive_threshold
from weight_sync_bench.tolerance.training import QUANTITIES
from weight_sync_bench.training import adversarial
from weight_sync_bench.training.batches import (
    BatchSpec,
    default_spec,
    segments_from_documents,
)
from weight_sync_bench.training.counts import count_collectives, expected_counts
from weight_sync_bench.training.floor import (
    PACKED_WITH_EMPTY_ROW,
    SMALL,
    SMALL_VARIANTS,
)
from weight_sync_bench.training.floor import thresholds_for as training_thresholds
from weight_sync_bench.training.mesh import Mesh, mesh_groups
from weight_sync_bench.training.mutations import (
    SEQUENCE_MUTATIONS,
    full_mask,
    training_mutation,
)
from weight_sync_bench.training.sequence_floor import (
    load_sequence,
    sequence_meshes,
    thresholds_for,
)
from weight_sync_bench.training.step import CORRECT, TrainingCase

TIED_BIASED = SMALL_VARIANTS[1]  # padded vocab 50 -> 52, tied embeddings, biases
SP_CP = Mesh(2, 2, sp=True, cp=2)
PLAIN = thresholds_for(SMALL, SP_CP)


def _assert_passes(report):
    failing = [f"{c.quantity}: {c.deviation:.3g} > {c.threshold:g} ({c.where})"
               for c in report.comparisons if not c.passed]
    assert not failing, f"{report.config} {report.mesh}: " + "; ".join(failing)


# -- equivalence ---------------------------------------------------------------------------

# The whole test is the long run's (6.3 s for toy-tp2-sp-packed, TOY's 19M parameters in a
# dense reference and two SP ranks). Its equivalent in the default run:
# test_every_sequence_mesh_of_every_variant_trains_like_the_reference trains TP x SP, CP and
# CP x TP x SP meshes (sp=True at tp 2 among them, packed; unpacked batches on drawn meshes in
# tests/training/test_sequence_properties.py) against the dense reference under the sequence
# artifact's thresholds, and a named config at TOY's width
# trains like the reference in tests/training/test_step.py
# (test_named_configs_train_like_the_reference[toy_kv4-dp1-tp4-packed]).
@pytest.mark.parametrize(("config", "mesh", "packed"), [
    pytest.param(TOY, Mesh(1, 2, sp=True), True, id="toy-tp2-sp-packed",
                 marks=pytest.mark.slow),
    # About 5 s (four full copies of TOY's 19M parameters): in the default run cp=4 is
    # test_every_sequence_mesh_of_every_variant_trains_like_the_reference (it asserts a
    # cp=4 mesh for each variant it trains; packed by default, unpacked in the long run and
    # on the meshes test_sequence_properties.py draws).
    pytest.param(TOY, Mesh(1, 1, cp=4), False, id="toy-cp4", marks=pytest.mark.slow),
    # 5 s: the long run; by default CP x TP x SP trains on SMALL variants (below)
    pytest.param(TOY_KV4, Mesh(1, 2, sp=True, cp=2), True, id="toy_kv4-tp2-sp-cp2-packed",
                 marks=pytest.mark.slow),
])
def test_named_configs_train_like_the_reference_under_sp_and_cp(config, mesh, packed):
    case = TrainingCase(config, mesh, seed=7, steps=2, spec=default_spec(config, packed=packed))
    _assert_passes(case.check(thresholds_for(config, mesh)))


# One of the six cells by default: packed, with an empty row (documents crossing the chunk
# edges, an all-masked chunk), on the variant with GQA and biases; all six in the long run.
# unpacked-small (2.8 s, eleven meshes) among them: by default unpacked batches train on
# drawn TP x SP x CP meshes of drawn geometries in tests/training/test_sequence_properties.py
# (test_correct_sequence_parallel_training_matches_the_reference), and on every DP x TP mesh
# of SMALL in tests/training/test_step.py
# (test_every_mesh_of_every_variant_trains_like_the_reference[unpacked-small]).
@pytest.mark.parametrize(("config", "spec"), breadth(
    [pytest.param(c, s, id=f"{sid}-{c.name}") for s, sid in (
        (default_spec(SMALL, packed=False), "unpacked"), (PACKED_WITH_EMPTY_ROW, "packed_with_empty_row"))
     for c in SMALL_VARIANTS],
    keep={"packed_with_empty_row-small_gqa_bias"}, name=lambda p: p.id))
def test_every_sequence_mesh_of_every_variant_trains_like_the_reference(config, spec):
    reference, meshes = None, sequence_meshes(config, spec.rows, spec.seq_len, dps=(2,))
    assert {(m.sp, m.cp) for m in meshes} >= {(True, 1), (False, 2), (True, 2), (False, 4)}
    for mesh in meshes:
        case = TrainingCase(config, mesh, seed=11, steps=2, spec=spec)
        reference = reference or case.reference()
        report = case.check(PLAIN, reference=reference)
        _assert_passes(report)
        assert report["replicas"].deviation == 0.0  # TP, CP and DP copies byte-identical
        assert report["padding_grad"].deviation == 0.0


def test_thresholds_come_from_the_sequence_artifact_by_the_project_rule():
    artifact = load_sequence()
    assert artifact["kind"] == "sequence" and artifact_path(kind="sequence").name == "sequence.json"
    for q in QUANTITIES:
        assert PLAIN[q] == derive_threshold(artifact["regimes"]["plain"][q]["worst"])
    # the plain DP x TP shape keeps training.json's thresholds
    assert thresholds_for(SMALL, Mesh(2, 2)) == training_thresholds(SMALL)


# -- layout: shapes, offsets, masks, spans and counts ---------------------------------------

def test_global_shapes_and_local_offsets_of_a_tp_sp_cp_replica():
    config, mesh = TIED_BIASED, Mesh(1, 2, sp=True, cp=2)
    case = TrainingCase(config, mesh, spec=PACKED_WITH_EMPTY_ROW)
    shards = split(case.params, layout_for(config), mesh.tp)
    tp, cp = mesh_groups(mesh)
    assert tp.ranks == (0, 1, 0, 1) and cp.ranks == (0, 0, 1, 1)
    model = ShardedModel(config, [shards[e % 2] for e in range(4)], tp, sequence_parallel=True,
                         context=cp)
    batch = case.batches[0]
    logits = model(batch.tokens, batch.segments, gather_logits=False)
    assert model.chunks(8) == [(0, 4), (0, 4), (4, 8), (4, 8)]
    assert model.embedding_positions == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [tuple(h.shape) for h in model.embedding_output] == [(4, 2, 32)] * 4  # (B, T/(cp t), d)
    assert [tuple(z.shape) for z in logits] == [(4, 4, 26)] * 4  # (B, T/cp, Vp/t)
    full = model(batch.tokens, batch.segments)
    assert [tuple(z.shape) for z in full] == [(4, 4, 50)] * 4  # (B, T/cp, vocab)


def test_context_chunks_see_exactly_the_dense_mask_across_chunk_edges():
    # documents of 3, 5 / 2, 6 / one of 8 / padding alone: boundaries on and off chunk edges
    seg = segments_from_documents(((3, 5), (2, 6), (8,), ()), 8)
    dense = document_mask(seg)
    for cp in (1, 2, 4, 8):
        assert torch.equal(full_mask(ShardedModel, seg, 4, 8, cp), dense)
        assert torch.equal(full_mask(ShardedModel, None, 4, 8, cp),
                           torch.ones(8, 8, dtype=torch.bool).tril().expand(4, 1, 8, 8))
    assert torch.equal(context_mask(seg, 4, 8, 8), dense[:, :, 4:8])


def test_an_all_masked_chunk_is_exactly_zero_and_receives_no_gradient():
    seg = torch.tensor([[0, 0, -1, -1]])  # the second chunk is padding: it sees no key
    q, k, v = (torch.randn(1, n, 2, 4, requires_grad=True) for n in (2, 4, 4))
    out = attend(q, k, v, context_mask(seg, 2, 4, 4), q_offset=2)  # (1, 2, 8)
    assert torch.equal(out, torch.zeros(1, 2, 8))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))


MESHES = [Mesh(1, 2), Mesh(1, 2, sp=True), Mesh(1, 4, sp=True), Mesh(1, 1, cp=2),
          Mesh(1, 2, cp=2), Mesh(1, 2, sp=True, cp=2), Mesh(1, 2, sp=True, cp=4)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_collectives_per_forward_and_backward_are_counted_and_span_their_groups(mesh):
    config = SMALL_VARIANTS[0]
    counts = count_collectives(TrainingCase(config, mesh, spec=PACKED_WITH_EMPTY_ROW))
    assert counts.counts == expected_counts(config, mesh)
    for (axis, _), spans in counts.spans.items():
        groups = mesh.tp_groups() if axis == "tp" else mesh.cp_groups()
        assert spans == {tuple(g) for g in groups}, (axis, spans)


def test_sp_replaces_every_residual_all_reduce_with_a_reduce_scatter():
    n = SMALL.n_layers  # 2
    sp = expected_counts(SMALL, Mesh(1, 2, sp=True))
    tp = expected_counts(SMALL, Mesh(1, 2))
    assert sp[("forward", "tp", "reduce_scatter")] + sp[("forward", "tp", "all_reduce")] \
        == tp[("forward", "tp", "all_reduce")] == 2 * n + 3  # 7
    assert sp[("forward", "tp", "all_gather")] == 2 * n + 2  # qkv, gate_up per layer; lm_head; max


# -- uneven splits --------------------------------------------------------------------------

@pytest.mark.parametrize(("mesh", "message"), [
    # 8 positions do not split into 3 context chunks
    (Mesh(1, 1, cp=3), "small: context parallelism needs seq_len % cp == 0 (seq_len=8, cp=3)"),
    # chunks of 2 positions do not split over 4 TP ranks
    (Mesh(1, 4, sp=True, cp=4),
     "small: sequence parallelism needs (seq_len / cp) % t == 0 (seq_len=8, cp=4, t=4)"),
])
def test_an_uneven_sequence_split_is_rejected_naming_the_rule(mesh, message):
    with pytest.raises(UnevenSequence) as info:
        TrainingCase(SMALL, mesh, spec=default_spec(SMALL, packed=False))
    assert str(info.value) == message


def test_the_model_itself_rejects_a_sequence_its_groups_cannot_split():
    mesh = Mesh(1, 1, cp=2)
    tp, cp = mesh_groups(mesh)
    shards = split(init_params(SMALL, 0), layout_for(SMALL), 1) * 2
    model = ShardedModel(SMALL, shards, tp, context=cp)
    with pytest.raises(UnevenSequence, match=r"seq_len % cp == 0 \(seq_len=7, cp=2\)"):
        model(torch.zeros(1, 7, dtype=torch.long))


# -- mutations -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exposing_case():
    """dp=2, tp=2 with SP, cp=2, packed rows whose documents cross the chunk edge (and a row
    of padding alone), loud biases: no sequence mutation is the identity here."""
    params = adversarial.loud_biases(TIED_BIASED, init_params(TIED_BIASED, 3))
    case = TrainingCase(TIED_BIASED, SP_CP, seed=3, spec=PACKED_WITH_EMPTY_ROW, params=params)
    return case, case.reference()


def test_the_unmutated_twin_of_the_sequence_exposing_case_passes(exposing_case):
    case, reference = exposing_case
    _assert_passes(case.check(PLAIN, reference=reference))


@pytest.mark.parametrize("name", [m.name for m in SEQUENCE_MUTATIONS])
def test_each_sequence_mutation_is_detected_where_it_is_not_the_identity(name, exposing_case):
    case, reference = exposing_case
    mutation = training_mutation(name)
    assert mutation.identity_reason(case) is None
    report = mutation.check(case, PLAIN, reference=reference)
    assert not report.passed
    assert report.worst.ratio > 10, f"{name}: only {report.worst.ratio:.3g}x"


IDENTITY_CASES = {
    "norm_grad_unreduced": dict(mesh=Mesh(2, 1, cp=2)),
    "norm_grad_reduced_twice": dict(mesh=Mesh(2, 1, cp=2)),
    "cp_grad_unreduced": dict(mesh=Mesh(2, 2, sp=True)),
    "cp_key_offset": dict(mesh=Mesh(2, 2, sp=True)),
    "cp_local_causal": dict(mesh=Mesh(2, 2, sp=True)),
    "cp_doc_boundary_ignored": dict(mesh=Mesh(2, 2, cp=2), spec=default_spec(SMALL, packed=False)),
    "sp_gather_backward_split": dict(mesh=Mesh(2, 2, cp=2)),
}


@pytest.mark.parametrize("name", [m.name for m in SEQUENCE_MUTATIONS])
def test_where_a_sequence_mutation_declares_itself_the_identity_it_changes_nothing(name):
    fields = {"spec": PACKED_WITH_EMPTY_ROW, **IDENTITY_CASES[name]}
    case = TrainingCase(TIED_BIASED, fields["mesh"], seed=2, spec=fields["spec"])
    mutation = training_mutation(name)
    assert mutation.identity_reason(case) is not None
    assert mutation.check(case, thresholds_for(TIED_BIASED, case.mesh)).passed


def test_ignoring_a_document_edge_no_query_meets_is_declared_the_identity():
    # each row one document, then padding: no real query meets another document's key
    # across the chunk edge (padding queries see nothing either way), so it is a no-op
    spec = BatchSpec(((8,), (6,)), 8, packed=True)
    case = TrainingCase(SMALL.replace(batch=2), Mesh(1, 1, cp=2), spec=spec)
    mutation = training_mutation("cp_doc_boundary_ignored")
    assert "no valid label depends" in mutation.identity_reason(case)
    assert mutation.check(case, PLAIN).passed
    crossing = TrainingCase(SMALL.replace(batch=2), Mesh(1, 1, cp=2),
                            spec=BatchSpec(((3, 5), (2, 6)), 8, packed=True))
    assert mutation.identity_reason(crossing) is None
    assert not mutation.check(crossing, PLAIN).passed


class _ReduceScatterEntry(ShardedModel):
    def enter_region(self, xs, tag):
        return self.collective.reduce_scatter(xs, dim=1, tag=tag) if self.sequence_parallel else xs


def test_the_forward_swap_of_reduce_scatter_and_all_gather_cannot_pass_silently():
    # the declared reason sp_gather_backward_split is injected in backward: swapped in the
    # forward, the shapes break at the first region, so no wrong number can come out
    case = TrainingCase(SMALL, Mesh(1, 2, sp=True), spec=default_spec(SMALL, packed=False))
    with pytest.raises(RuntimeError):
        case.sharded(replace(CORRECT, model=_ReduceScatterEntry))


def test_a_key_offset_no_valid_label_reads_is_declared_the_identity():
    # the last chunk (positions 4-7) is padding: only its queries read the rolled keys
    config = SMALL.replace(batch=2)
    case = TrainingCase(config, Mesh(1, 1, cp=2), spec=BatchSpec(((4,), (3,)), 8))
    mutation = training_mutation("cp_key_offset")
    assert "no valid label depends on a last-chunk query" in mutation.identity_reason(case)
    assert mutation.check(case, PLAIN).passed
    reaching = TrainingCase(config, Mesh(1, 1, cp=2), spec=BatchSpec(((6,), (3,)), 8))
    assert mutation.identity_reason(reaching) is None
    assert not mutation.check(reaching, PLAIN).passed


def test_a_key_offset_the_last_query_reads_in_another_order_only_is_the_identity():
    # chunks of one position: the last query sees every key, so reading them rotated by one
    # is a reordering of the same softmax; an earlier-ending row makes it visible
    config = SMALL.replace(batch=2, seq_len=4)
    mutation = training_mutation("cp_key_offset")
    case = TrainingCase(config, Mesh(1, 1, cp=4), spec=BatchSpec(((4,), (4,)), 4))
    assert mutation.identity_reason(case) is not None
    assert mutation.check(case, PLAIN).passed
    packed = TrainingCase(config, Mesh(1, 1, cp=4), spec=BatchSpec(((2, 2), (4,)), 4,
                                                                   packed=True))
    assert mutation.identity_reason(packed) is None
    assert not mutation.check(packed, PLAIN).passed
