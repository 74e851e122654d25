"""``verify_state`` read whole (issue 30, the mutation pass over ``check/state.py``): every
kind of outcome planted on the *last* rank and every field of every outcome compared (name,
outcome, detail, source, experts), the report's summary compared line for line, and the
inputs the first tests never gave: an ``Endpoint`` instead of a string, every rank at once,
a ``bool`` for a rank, an engine in a 1-byte or 8-byte dtype, a padded cut of another rank,
a stacked tensor of the wrong shape or with one wrong member. Each has its twin: a correct
sync passes, byte for byte the same recipe without the fault."""

from __future__ import annotations

import pytest
import torch

from tests.check.test_state import CONFIG, MOE, QKV, SENTINEL, engine, sync
from tests.sync.conftest import tiny
from weight_sync_bench.check.state import (
    _experts_of,
    _Recent,
    verify_ranks,
    verify_state,
)
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.maps import Piece
from weight_sync_bench.errors import InvalidShards
from weight_sync_bench.model.config import init_params

WHERE = "vllm:2"
L = "model.layers.{}."
O_PROJ = L + "self_attn.o_proj.weight"
IN_NORM, POST_NORM = L + "input_layernorm.weight", L + "post_attention_layernorm.weight"
STACKED = ("two pipeline stages publishing the same local indices, or a stage's offset "
           "wrong")


@pytest.fixture(scope="module")
def weights():
    return init_params(CONFIG, 0), init_params(CONFIG, 1)


def _every_fault_on_the_last_rank(new, old):
    """Rank 1 of ``vllm:2`` synced with one of each fault, and what each must be called."""
    declared = materialize(endpoint(WHERE).pieces(CONFIG), new)
    before = materialize(endpoint(WHERE).pieces(CONFIG), old)
    faults = {QKV.format(1): before[1][QKV.format(1)],  # stale
              O_PROJ.format(0): declared[1][O_PROJ.format(3)],  # another layer's
              IN_NORM.format(1): declared[1][POST_NORM.format(1)]}  # this rank's other name
    state = sync(engine(CONFIG, WHERE, new), CONFIG, WHERE, new,
                 source=lambda rank, name: faults.get(name) if rank == 1 else None,
                 skip=lambda rank, name: rank == 1 and name == QKV.format(2))  # never written
    held = state[1]
    held[QKV.format(3)][:4] = SENTINEL  # partly never written
    del held["model.norm.weight"]  # missing
    held["model.layers.0.mlp.extra"] = torch.zeros(2, dtype=torch.bfloat16)  # unexpected
    held[POST_NORM.format(2)] = held[POST_NORM.format(2)].float()  # the dtype declared: bf16
    return state


def test_every_outcome_on_the_last_rank_with_every_field(weights):
    new, old = weights
    state = _every_fault_on_the_last_rank(new, old)
    report = verify_state(state[1], WHERE, 1, new, config=CONFIG, previous=old,
                          sentinel=SENTINEL, dtype=torch.bfloat16)
    got = {o.name: o for o in report.outcomes if o.outcome != "equal"}
    qkv_numel = state[1][QKV.format(3)].numel()
    want = {
        QKV.format(1): ("stale", "holds the previous weights' declared bytes: this sync never "
                        "wrote it", "layers.1.qkv.weight"),
        O_PROJ.format(0): ("misplaced", f"holds layer 3's o_proj.weight, cut as declared: a "
                           f"layer stored under another layer's name ({STACKED})",
                           "layers.0.o_proj.weight"),
        IN_NORM.format(1): ("misplaced", "holds this rank's declared "
                            f"{POST_NORM.format(1)}", "layers.1.attn_norm.weight"),
        QKV.format(2): ("never written", "every element holds the sentinel -7 filled in before "
                        "the sync", "layers.2.qkv.weight"),
        QKV.format(3): ("partly never written", f"{4 * CONFIG.d_model} of {qkv_numel} elements "
                        "hold the sentinel -7, the others their declared bytes",
                        "layers.3.qkv.weight"),
        POST_NORM.format(2): ("wrong", "torch.float32 [32], declared torch.bfloat16 [32]",
                              "layers.2.ffn_norm.weight"),
        "model.norm.weight": ("missing", "vllm:2 declares it on rank 1", "norm.weight"),
        "model.layers.0.mlp.extra": ("unexpected", "vllm:2 declares no model.layers.0.mlp.extra "
                                     "on rank 1", None),
    }
    assert {n: (o.outcome, o.detail, o.source) for n, o in got.items()} == want
    assert all(o.experts == () for o in report.outcomes)
    assert [o.name for o in report.outcomes][-1] == "model.layers.0.mlp.extra"  # last

    equal = len(report.outcomes) - len(want)
    lines = report.summary().split("\n")
    assert lines[0] == (f"FAIL vllm:2 rank 1: {equal} equal, 1 stale, 1 never written, "
                        "1 partly never written, 2 misplaced, 1 wrong, 1 missing, 1 unexpected")
    assert lines[1:1 + len(want)] == [
        f"  {o.outcome}: {o.name}: {o.detail}" for o in report.outcomes if o.outcome != "equal"]
    assert lines[1 + len(want):] == ["  coverage:"] + [f"    {c}" for c in report.coverage()]
    assert report.coverage() == [
        "layer 0: 5 equal, 1 misplaced", "layer 1: 4 equal, 1 stale, 1 misplaced",
        "layer 2: 4 equal, 1 never written, 1 wrong", "layer 3: 5 equal, 1 partly never written",
        "embedding and output: 2 equal, 1 missing"]
    assert str(report) == report.summary()


def test_a_passing_report_reads_pass_and_lists_nothing_but_coverage(weights):
    new, _ = weights
    state = sync(engine(CONFIG, WHERE, new), CONFIG, WHERE, new)
    report = verify_state(state[1], WHERE, 1, new, config=CONFIG, dtype=torch.bfloat16)
    assert report.summary() == "\n".join(
        [f"PASS vllm:2 rank 1: {len(state[1])} equal", "  coverage:"]
        + [f"    layer {k}: 6 equal" for k in range(4)] + ["    embedding and output: 3 equal"])


def test_every_rank_at_once_from_an_endpoint_object_with_the_fault_on_the_last(weights):
    new, old = weights
    state = _every_fault_on_the_last_rank(new, old)
    reports = verify_ranks(state, endpoint(WHERE), new, config=CONFIG, previous=old,
                           sentinel=SENTINEL, dtype=torch.bfloat16)
    assert [(r.where, r.rank, r.passed) for r in reports] == [("vllm:2", 0, True),
                                                              ("vllm:2", 1, False)]
    alone = verify_state(state[1], endpoint(WHERE), 1, new, config=CONFIG, previous=old,
                         sentinel=SENTINEL, dtype=torch.bfloat16)
    assert reports[1].outcomes == alone.outcomes


def test_a_rank_that_is_a_bool_or_a_dump_that_is_a_list_is_refused_naming_it(weights):
    new, _ = weights
    state = sync(engine(CONFIG, WHERE, new), CONFIG, WHERE, new)
    with pytest.raises(InvalidShards, match="rank True is outside its 2 ranks"):
        verify_state(state[1], WHERE, True, new, config=CONFIG)
    with pytest.raises(InvalidShards, match="vllm:2 rank 1: the engine's tensors must be a "
                                            "mapping of names to tensors, got list"):
        verify_ranks([state[0], [1]], WHERE, new, config=CONFIG)
    assert verify_state(state[1], WHERE, 1, new, config=CONFIG,
                        dtype=torch.bfloat16).passed  # the twin: an int rank


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float64])
def test_another_ranks_cut_is_found_in_a_1_or_8_byte_engine(dtype):
    new = init_params(CONFIG, 0)
    declared = materialize(endpoint(WHERE).pieces(CONFIG), new)
    state = [{n: x.to(dtype) for n, x in rank.items()} for rank in declared]
    assert verify_state(state[1], WHERE, 1, new, config=CONFIG, dtype=dtype).passed
    state[1][QKV.format(0)] = state[0][QKV.format(0)]
    (moved,) = [o for o in verify_state(state[1], WHERE, 1, new, config=CONFIG,
                                        dtype=dtype).outcomes if o.outcome != "equal"]
    assert (moved.outcome, moved.detail) == (
        "misplaced", f"holds rank 0's declared {QKV.format(0)}: another rank's cut")


def test_another_ranks_padded_cut_is_misplaced_not_wrong():
    """vLLM pads a 250-row vocabulary to 256: rank 1's embedding ends in six padding rows.
    Rank 0 holding it holds another rank's cut, padding included."""
    config = CONFIG.replace(vocab=250, name="tiny_padded")
    new = init_params(config, 0)
    declared = materialize(endpoint(WHERE).pieces(config), new)
    emb = "model.embed_tokens.weight"
    state = [{n: x.clone() for n, x in rank.items()} for rank in declared]
    state[0][emb] = declared[1][emb].clone()
    (moved,) = [o for o in verify_state(state[0], WHERE, 0, new, config=config).outcomes
                if o.outcome != "equal"]
    assert (moved.outcome, moved.detail) == (
        "misplaced", f"holds rank 1's declared {emb}: another rank's cut")
    state[0][emb][-1, 0] = 1.0  # the twin: one padding element not zero is nobody's cut
    (bad,) = [o for o in verify_state(state[0], WHERE, 0, new, config=config).outcomes
              if o.outcome != "equal"]
    assert bad.outcome == "wrong"


def test_the_sentinel_left_is_counted_apart_from_declared_elements_equal_to_it():
    """Sentinel 0 over an embedding whose last six rows are declared padding (zeros): two
    rows left unwritten are 2 x d elements, not those plus the padding's."""
    config = CONFIG.replace(vocab=250, name="tiny_padded")
    new = init_params(config, 0)
    declared = materialize(endpoint(WHERE).pieces(config), new)
    emb = "model.embed_tokens.weight"
    held = {**declared[1], emb: declared[1][emb].clone()}
    held[emb][:2] = 0.0
    (part,) = [o for o in verify_state(held, WHERE, 1, new, config=config,
                                       sentinel=0.0).outcomes if o.outcome != "equal"]
    assert (part.outcome, part.detail) == (
        "partly never written", f"{2 * config.d_model} of {held[emb].numel()} elements hold "
        "the sentinel 0, the others their declared bytes")


W13 = "model.layers.{}.mlp.experts.routed_experts.w13_weight"


def test_a_stacked_tensor_is_judged_member_by_member_on_the_last_rank():
    where = "vllm:tp=2,ep=2"
    new = init_params(MOE, 0)
    declared = materialize(endpoint(where).pieces(MOE), new)
    state = [{n: x.clone() for n, x in rank.items()} for rank in declared]
    state[1][W13.format(1)][1, 0, 0] += 1.0  # one element of rank 1's second expert (3)
    got = [o for o in verify_state(state[1], where, 1, new, config=MOE).outcomes
           if o.name.startswith(W13.format(1))]
    assert [(o.name, o.outcome, o.experts, o.source) for o in got] == [
        (W13.format(1) + "[0]", "equal", (2,), "layers.1.experts.gate_up.weight"),
        (W13.format(1) + "[1]", "wrong", (3,), "layers.1.experts.gate_up.weight")]
    assert got[1].detail.startswith(f"rank 1 {W13.format(1)}[1] holds"), got[1].detail
    # a stacked tensor missing an expert is wrong as a whole, its shape said
    state[1][W13.format(1)] = declared[1][W13.format(1)][:1].clone()
    (short,) = [o for o in verify_state(state[1], where, 1, new, config=MOE).outcomes
                if o.outcome != "equal"]
    assert (short.name, short.outcome, short.experts) == (W13.format(1), "wrong", (2, 3))
    assert short.detail.startswith("torch.float32 [1, ")


def test_the_experts_of_a_cut_holding_only_expert_0s_first_index():
    config = tiny(2, n_layers=1, n_experts=4, top_k=2, expert_ffn=16).replace(name="m")
    down = "layers.0.experts.down.weight"
    assert _experts_of(config, Piece(down, 1, torch.tensor([0]))) == (0,)
    assert _experts_of(config, Piece(down, 1, torch.tensor([16, -1]))) == (1,)
    assert _experts_of(config, Piece("layers.0.qkv.weight", 0, torch.tensor([0]))) == ()


def test_recent_weights_answer_membership_and_iteration_without_reading():
    reads = []

    class Counted(dict):
        def __getitem__(self, name):
            reads.append(name)
            return super().__getitem__(name)

    recent = _Recent(Counted(a=torch.zeros(1), b=torch.ones(1)))
    assert "a" in recent and "c" not in recent and list(recent) == ["a", "b"]
    assert len(recent) == 2 and reads == []
    assert recent["b"] is recent["b"] and reads == ["b"]  # read once, kept


def test_a_layer_found_in_another_dtype_is_confirmed_in_the_held_dtype():
    """Weights of mixed dtypes read as they are (no ``dtype=``): layer 1's norm kept in bf16
    beside layer 0's in fp32, and the engine holding layer 1's values, upcast, under layer
    0's name. Its digests match after the cast, and so must the confirmation."""
    new = init_params(CONFIG, 0)
    new["layers.1.attn_norm.weight"] = new["layers.1.attn_norm.weight"].to(torch.bfloat16)
    declared = materialize(endpoint(WHERE).pieces(CONFIG), new)
    held = {**declared[1], IN_NORM.format(0): declared[1][IN_NORM.format(1)].float()}
    (moved,) = [o for o in verify_state(held, WHERE, 1, new, config=CONFIG).outcomes
                if o.outcome != "equal"]
    assert (moved.outcome, moved.detail.split(",")[0]) == (
        "misplaced", "holds layer 1's attn_norm.weight")
    assert verify_state(declared[1], WHERE, 1, new, config=CONFIG).passed  # the twin
