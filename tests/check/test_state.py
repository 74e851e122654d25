"""``verify_state`` on a stand-in engine: each rank a dict of the ``vllm`` convention's
tensors in bfloat16, filled with a sentinel, then synced by a recipe with one planted fault.
Every fault is named as what it is (never written, stale, misplaced and whose, wrong with
the diagnosis, missing, unexpected), and the twin, a correct sync, reports every tensor
equal: the same recipe, the fault left out."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.check.state import OUTCOMES, verify_state
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.errors import InvalidShards
from weight_sync_bench.model.config import init_params
from tests.sync.conftest import tiny

CONFIG = tiny(2, n_layers=4)
MOE = tiny(4, n_layers=2, n_experts=4, top_k=2, expert_ffn=16).replace(name="tiny_moe")
SENTINEL = -7.0
QKV = "model.layers.{}.self_attn.qkv_proj.weight"


def engine(config, where, weights, *, fill=SENTINEL):
    """The stand-in engine's ranks: every declared tensor in bfloat16, holding ``fill``."""
    return [{n: torch.full_like(x, fill, dtype=torch.bfloat16) for n, x in rank.items()}
            for rank in materialize(endpoint(where).pieces(config), weights)]


def sync(state, config, where, weights, *, skip=lambda rank, name: False, source=None):
    """A correct sync into ``state`` (each tensor the declared one, cast by ``.to``), but for
    the names ``skip`` leaves out; ``source(rank, name)``: other declared bytes to write."""
    declared = materialize(endpoint(where).pieces(config), weights)
    for rank, held in enumerate(state):
        for name in held:
            if not skip(rank, name):
                value = source(rank, name) if source is not None else None
                held[name].copy_(declared[rank][name] if value is None else value)
    return state


@pytest.fixture(scope="module")
def weights():
    return init_params(CONFIG, 0), init_params(CONFIG, 1)


def check(state, rank, weights, where="vllm:2", config=CONFIG, **kw):
    return verify_state(state[rank], where, rank, weights, config=config,
                        sentinel=SENTINEL, dtype=torch.bfloat16, **kw)


def test_a_correct_sync_is_equal_everywhere(weights):
    new, old = weights
    state = sync(engine(CONFIG, "vllm:2", new), CONFIG, "vllm:2", new)
    for rank in range(2):
        report = check(state, rank, new, previous=old)
        assert report.passed, report.summary()
        assert report.counts() == {"equal": len(state[rank])}
    assert report.coverage()[0] == "layer 0: 6 equal"
    assert report.coverage()[-1] == "embedding and output: 3 equal"


def test_half_the_layers_never_written_and_the_rest_misplaced(weights):
    """Two stages publishing the same local names (NVIDIA-NeMo/RL PR #3259): the second
    stage's layers 2-3 land in layers 0-1, layers 2-3 keep the sentinel."""
    new, _ = weights
    declared = materialize(endpoint("vllm:2").pieces(CONFIG), new)

    def local(rank, name):  # layer k+2's bytes under layer k's name
        for k in (0, 1):
            if f"layers.{k}." in name:
                return declared[rank][name.replace(f"layers.{k}.", f"layers.{k + 2}.")]
        return None

    state = sync(engine(CONFIG, "vllm:2", new), CONFIG, "vllm:2", new, source=local,
                 skip=lambda rank, name: "layers.2." in name or "layers.3." in name)
    report = check(state, 0, new)
    assert not report.passed
    by = {o.name: o for o in report.outcomes}
    assert by[QKV.format(3)].outcome == "never written"
    assert by[QKV.format(0)].outcome == "misplaced"
    assert "holds layer 2's qkv.weight, cut as declared" in by[QKV.format(0)].detail
    assert "layer 0: 6 misplaced" in report.coverage()
    assert "layer 3: 6 never written" in report.coverage()
    assert report.counts() == {"equal": 3, "never written": 12, "misplaced": 12}


def test_a_chunk_restored_from_the_previous_weights_is_stale(weights):
    """SkyRL #1680: a multi-chunk sync restoring one chunk's layers from the old weights."""
    new, old = weights
    before = materialize(endpoint("vllm:2").pieces(CONFIG), old)
    state = sync(engine(CONFIG, "vllm:2", new), CONFIG, "vllm:2", new,
                 source=lambda r, n: before[r][n] if "layers.1." in n else None)
    report = check(state, 1, new, previous=old)
    assert report.counts() == {"equal": 21, "stale": 6}
    assert "layer 1: 6 stale" in report.coverage()
    without = check(state, 1, new)  # the twin without previous=: only "wrong" is left to say
    assert without.counts()["wrong"] == 6


def test_an_lm_head_left_stale_is_named(weights):
    """vllm PR #51665 / prime-rl PR #2823: the output layer never updated."""
    new, old = weights
    before = materialize(endpoint("vllm:2").pieces(CONFIG), old)
    state = sync(engine(CONFIG, "vllm:2", new), CONFIG, "vllm:2", new,
                 source=lambda r, n: before[r][n] if n == "lm_head.weight" else None)
    report = check(state, 0, new, previous=old)
    (stale,) = [o for o in report.outcomes if o.outcome != "equal"]
    assert (stale.name, stale.outcome) == ("lm_head.weight", "stale")
    assert "embedding and output: 2 equal, 1 stale" in report.coverage()


def test_one_tensor_from_the_wrong_rank_is_misplaced_and_whose(weights):
    new, _ = weights
    declared = materialize(endpoint("vllm:2").pieces(CONFIG), new)
    state = sync(engine(CONFIG, "vllm:2", new), CONFIG, "vllm:2", new,
                 source=lambda r, n: declared[1][n] if (r, n) == (0, QKV.format(2)) else None)
    (wrong,) = [o for o in check(state, 0, new).outcomes if o.outcome != "equal"]
    assert wrong.outcome == "misplaced" and wrong.name == QKV.format(2)
    assert wrong.detail == f"holds rank 1's declared {QKV.format(2)}: another rank's cut"


def test_a_bf16_cast_by_truncation_is_told_apart(weights):
    new, _ = weights
    declared = materialize(endpoint("vllm:2").pieces(CONFIG), new)

    def truncated(rank, name):
        if name != QKV.format(1):
            return None
        bits = declared[rank][name].contiguous().view(torch.int32) >> 16
        return bits.to(torch.int16).view(torch.bfloat16)

    state = sync(engine(CONFIG, "vllm:2", new), CONFIG, "vllm:2", new, source=truncated)
    (wrong,) = [o for o in check(state, 0, new).outcomes if o.outcome != "equal"]
    assert wrong.outcome == "wrong" and "by truncation (round toward zero)" in wrong.detail


def test_other_wrong_bytes_get_the_diagnosis_in_heads(weights):
    new, _ = weights
    declared = materialize(endpoint("vllm:2").pieces(CONFIG), new)
    hd, q = CONFIG.head_dim, CONFIG.q_rows // 2  # rank 0's Q rows, then its K and V head

    def swapped(rank, name):  # rank 0's first Q head and its K head exchanged
        if (rank, name) != (0, QKV.format(0)):
            return None
        x = declared[0][name].clone()
        x[:hd], x[q:q + hd] = declared[0][name][q:q + hd], declared[0][name][:hd]
        return x

    state = sync(engine(CONFIG, "vllm:2", new), CONFIG, "vllm:2", new, source=swapped)
    (wrong,) = [o for o in check(state, 0, new).outcomes if o.outcome != "equal"]
    assert wrong.outcome == "wrong"
    assert wrong.detail.startswith(f"rank 0 {QKV.format(0)} holds K head 0, Q heads 1-3, "
                                   "Q head 0, V head 0"), wrong.detail


def test_missing_partly_written_and_unexpected_names(weights):
    new, _ = weights
    state = sync(engine(CONFIG, "vllm:2", new), CONFIG, "vllm:2", new)
    held = dict(state[0])
    del held["model.norm.weight"]
    held["model.layers.0.mlp.extra"] = torch.zeros(2, dtype=torch.bfloat16)
    held[QKV.format(3)] = held[QKV.format(3)].clone()
    held[QKV.format(3)][:4] = SENTINEL  # four rows left as they were
    report = verify_state(held, "vllm:2", 0, new, config=CONFIG, sentinel=SENTINEL,
                          dtype=torch.bfloat16)
    by = {o.name: o for o in report.outcomes}
    assert by["model.norm.weight"].outcome == "missing"
    assert by["model.layers.0.mlp.extra"].outcome == "unexpected"
    assert by[QKV.format(3)].outcome == "partly never written"
    assert by[QKV.format(3)].detail == f"{4 * CONFIG.d_model} of " \
        f"{state[0][QKV.format(3)].numel()} elements hold the sentinel -7, the others their " \
        "declared bytes"
    assert list(report.counts()) == [o for o in OUTCOMES if o in report.counts()]


def test_an_expert_bucket_never_written_is_named_per_expert():
    """vLLM EP 2: rank 1's stacked experts of layer 1 never synced (a bucket dropped)."""
    new = init_params(MOE, 0)
    where = "vllm:tp=2,ep=2"
    state = sync(engine(MOE, where, new), MOE, where, new,
                 skip=lambda r, n: r == 1 and "layers.1.mlp.experts" in n)
    report = verify_state(state[1], where, 1, new, config=MOE, sentinel=SENTINEL,
                          dtype=torch.bfloat16)
    # the stacked tensors (w13, w2: experts 2-3 of rank 1), never written as a whole
    assert report.counts() == {"equal": len(state[1]) - 2, "never written": 2}
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    assert "layer 1 experts 2-3: 2 never written" in report.coverage()
    assert "layer 0 experts 2-3: 2 equal" in report.coverage()
    # one expert of the bucket dropped: the other is equal, and said so
    one = sync(engine(MOE, where, new), MOE, where, new)
    one[1][w13][1].fill_(SENTINEL)
    report = verify_state(one[1], where, 1, new, config=MOE, sentinel=SENTINEL,
                          dtype=torch.bfloat16)
    assert {o.name: o.outcome for o in report.outcomes if o.name.startswith(w13)} == {
        f"{w13}[0]": "equal", f"{w13}[1]": "never written"}
    assert "layer 1 expert 3: 1 never written" in report.coverage()
    twin = verify_state(sync(engine(MOE, where, new), MOE, where, new)[1], where, 1, new,
                        config=MOE, sentinel=SENTINEL, dtype=torch.bfloat16)
    assert twin.passed


def test_a_dtype_or_shape_other_than_declared_is_wrong_and_bad_input_is_refused(weights):
    new, _ = weights
    state = sync(engine(CONFIG, "vllm:2", new), CONFIG, "vllm:2", new)
    held = {**state[0], QKV.format(0): state[0][QKV.format(0)].float()}
    report = verify_state(held, "vllm:2", 0, new, config=CONFIG, dtype=torch.bfloat16)
    assert {o.name: o.detail for o in report.outcomes if o.outcome == "wrong"} == {
        QKV.format(0): f"torch.float32 {list(held[QKV.format(0)].shape)}, declared "
                       f"torch.bfloat16 {list(held[QKV.format(0)].shape)}"}
    with pytest.raises(InvalidShards, match="rank 2 is outside its 2 ranks"):
        verify_state(state[0], "vllm:2", 2, new, config=CONFIG)
    with pytest.raises(InvalidShards, match="must be a mapping of names to tensors"):
        verify_state([1, 2], "vllm:2", 0, new, config=CONFIG)
    with pytest.raises(InvalidShards, match=f"rank 0 {QKV.format(0)}: .* got a list"):
        verify_state({**state[0], QKV.format(0): [1]}, "vllm:2", 0, new, config=CONFIG)


def test_an_engine_in_the_weights_dtype_is_compared_in_place(weights):
    """fp32 weights into an fp32 engine: a declared cut that is one run of its parameter is
    read in place (a view), every rank's (rank 1's o_proj columns start past 0)."""
    new, _ = weights
    declared = materialize(endpoint("vllm:2").pieces(CONFIG), new)
    state = [{n: x.clone() for n, x in rank.items()} for rank in declared]
    for rank in range(2):
        assert verify_state(state[rank], "vllm:2", rank, new, config=CONFIG).passed
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    state[1][o_proj] = declared[0][o_proj].clone()
    (wrong,) = [o for o in verify_state(state[1], "vllm:2", 1, new, config=CONFIG).outcomes
                if o.outcome != "equal"]
    assert (wrong.name, wrong.outcome) == (o_proj, "misplaced")
    assert wrong.detail == f"holds rank 0's declared {o_proj}: another rank's cut"


def test_a_tied_output_layers_copy_left_stale_is_named():
    """vllm PR #51665 / prime-rl PR #2823: with tied embeddings, a copy of the table that the
    sync never reached. Megatron's last pipeline stage holds one (``output_layer.weight``,
    cut from the embedding): the engine updated the embedding, not the copy."""
    config = tiny(2, n_layers=2, tie_embeddings=True).replace(name="tiny_tied")
    new, old = init_params(config, 0), init_params(config, 1)
    where = "megatron:tp=1,pp=2"
    before = materialize(endpoint(where).pieces(config), old)
    state = sync(engine(config, where, new), config, where, new,
                 source=lambda r, n: before[r][n] if n == "output_layer.weight" else None)
    report = verify_state(state[1], where, 1, new, config=config, previous=old,
                          sentinel=SENTINEL, dtype=torch.bfloat16)
    (stale,) = [o for o in report.outcomes if o.outcome != "equal"]
    assert (stale.name, stale.outcome, stale.source) == (
        "output_layer.weight", "stale", "tok_embeddings.weight")
    assert verify_state(state[0], where, 0, new, config=config, previous=old,
                        dtype=torch.bfloat16).passed  # the first stage's embedding: synced


def test_the_sentinel_counts_only_where_the_declared_bytes_differ_from_it(weights):
    """Sentinel 0 where the declared tensor has zeros (vLLM's vocabulary padding): a fully
    written tensor is equal; one wrong element elsewhere is wrong, not partly never written;
    a misplaced tensor that holds the sentinel somewhere is still misplaced."""
    new, _ = weights
    config = CONFIG.replace(vocab=250, name="tiny_padded")  # vLLM pads 250 rows to 256
    full = init_params(config, 0)
    declared = materialize(endpoint("vllm:2").pieces(config), full)
    emb = "model.embed_tokens.weight"
    state = [{n: x.clone() for n, x in rank.items()} for rank in declared]
    assert verify_state(state[1], "vllm:2", 1, full, config=config, sentinel=0.0).passed
    state[1][emb][0, 0] += 1.0
    (bad,) = [o for o in verify_state(state[1], "vllm:2", 1, full, config=config,
                                      sentinel=0.0).outcomes if o.outcome != "equal"]
    assert (bad.name, bad.outcome) == (emb, "wrong"), bad
    state[1][emb] = declared[1][emb].clone()
    state[1][emb][:2] = 0.0  # two rows left at the sentinel, and one element wrong besides
    state[1][emb][5, 0] += 1.0
    (bad,) = [o for o in verify_state(state[1], "vllm:2", 1, full, config=config,
                                      sentinel=0.0).outcomes if o.outcome != "equal"]
    assert bad.outcome == "wrong", bad  # not "partly never written": it is more than that
    state[1][emb] = declared[0][emb].clone()  # rank 0's rows: no padding, but a misplace
    (moved,) = [o for o in verify_state(state[1], "vllm:2", 1, full, config=config,
                                        sentinel=0.0).outcomes if o.outcome != "equal"]
    assert moved.outcome == "misplaced" and "rank 0's declared" in moved.detail


def test_whose_bytes_a_tensor_holds_costs_one_read_of_each_parameter():
    """Every tensor of a rank holding another layer's bytes (8 layers rotated by one): the
    misplaced search reads each parameter at most three times (its own check, its digests,
    the confirmation of the one candidate that matches), not once per other layer."""
    config = tiny(2, n_layers=8).replace(name="tiny_deep8")
    new = init_params(config, 0)
    declared = materialize(endpoint("vllm:2").pieces(config), new)

    def layer(name):
        return next((j for j in range(8) if f"layers.{j}." in name), None)

    rotated = {n: declared[0][n.replace(f"layers.{layer(n)}.", f"layers.{(layer(n) + 1) % 8}.")]
               if layer(n) is not None else x for n, x in declared[0].items()}
    reads: list[str] = []

    class Counted(dict):
        def __getitem__(self, name):
            reads.append(name)
            return super().__getitem__(name)

    report = verify_state(rotated, "vllm:2", 0, Counted(new), config=config)
    assert report.counts() == {"equal": 3, "misplaced": 48}
    assert all(o.detail.startswith(f"holds layer {(o.layer + 1) % 8}'s") for o in
               report.outcomes if o.outcome == "misplaced")
    assert max(reads.count(n) for n in set(reads)) <= 3, sorted(
        (reads.count(n), n) for n in set(reads))[-3:]


def test_a_stacked_tensor_of_another_rank_is_misplaced_as_a_whole():
    new = init_params(MOE, 0)
    where = "vllm:tp=2,ep=2"
    declared = materialize(endpoint(where).pieces(MOE), new)
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    state = [{n: x.clone() for n, x in rank.items()} for rank in declared]
    state[1][w13] = declared[0][w13].clone()  # rank 0's experts 0-1 where 2-3 belong
    (moved,) = [o for o in verify_state(state[1], where, 1, new, config=MOE).outcomes
                if o.outcome != "equal"]
    assert (moved.name, moved.outcome) == (w13, "misplaced")
    assert moved.detail == f"holds rank 0's declared {w13}: another rank's cut"


def test_equal_means_the_same_bits_not_the_same_value(weights):
    """-0.0 where +0.0 is declared, and a NaN of another payload, are not equal: the
    comparison is of bytes (``bit_equal``), never of values."""
    new, _ = weights
    declared = materialize(endpoint("vllm:2").pieces(CONFIG), new)
    norm = "model.norm.weight"
    zeros = {**new, "norm.weight": torch.zeros_like(new["norm.weight"])}
    held = {**declared[0], norm: -torch.zeros_like(declared[0][norm])}
    (signed,) = [o for o in verify_state(held, "vllm:2", 0, zeros, config=CONFIG).outcomes
                 if o.outcome != "equal"]
    assert signed.name == norm and signed.outcome == "wrong"
    nan = torch.full_like(new["norm.weight"], float("nan"))
    other = nan.clone().view(torch.int32).bitwise_xor_(1).view(torch.float32)  # another payload
    held = {**declared[0], norm: other}
    (payload,) = [o for o in verify_state(held, "vllm:2", 0, {**new, "norm.weight": nan},
                                          config=CONFIG).outcomes if o.outcome != "equal"]
    assert payload.name == norm and payload.outcome == "wrong"
    assert verify_state({**declared[0], norm: nan.clone()}, "vllm:2", 0,
                        {**new, "norm.weight": nan}, config=CONFIG).passed  # the twin
