"""``check.weights`` (issue 30, the mutation pass over ``check/weights.py``): real weights
taken as a check's source (every parameter, its shape, floating point; each refusal naming
the first that is not), the dtype a check on them is named by, and the threshold measured on
them: over which ends and seeds, the worst of which forwards, and the note that says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.check import weights
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.config import init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET

CONFIG = tiny(2, n_layers=1)


def test_held_weights_are_the_configs_parameters_in_its_order_the_tensors_given():
    given = dict(reversed(list(init_params(CONFIG, 1).items())))
    given["extra.weight"] = torch.zeros(3)  # not the config's: left out
    held = weights.held_weights(given, CONFIG)
    assert list(held) == list(CONFIG.param_shapes())
    assert all(held[n] is given[n] for n in held)


@pytest.mark.parametrize("kind", [str, Path])
def test_a_checkpoint_directory_is_read_as_the_configs_weights(monkeypatch, kind):
    asked = []
    drawn = init_params(CONFIG, 2)
    monkeypatch.setattr(weights, "read_weights",
                        lambda where, config: asked.append((where, config)) or drawn)
    held = weights.held_weights(kind("/ckpt"), CONFIG)
    assert asked == [(kind("/ckpt"), CONFIG)] and held == drawn


def test_missing_weights_are_refused_naming_the_first_and_how_many():
    drawn = init_params(CONFIG, 0)
    names = list(drawn)
    for n in names[1:3]:
        del drawn[n]
    with pytest.raises(InvalidConfig, match=rf"^weights: tiny_kv2 has {names[1]}, the weights "
                                            r"do not \(2 missing\)$"):
        weights.held_weights(drawn, CONFIG)


def test_a_wrong_shape_or_a_non_tensor_is_refused_naming_it_and_the_declared_shape():
    drawn = init_params(CONFIG, 0)
    name, shape = "norm.weight", list(CONFIG.param_shapes()["norm.weight"])
    with pytest.raises(InvalidConfig, match=rf"^weights: {name} is \[{shape[0] + 1}\], "
                                            rf"tiny_kv2 declares \[{shape[0]}\]$"):
        weights.held_weights({**drawn, name: torch.zeros(shape[0] + 1)}, CONFIG)
    with pytest.raises(InvalidConfig, match=rf"^weights: {name} is list, tiny_kv2 declares "
                                            rf"\[{shape[0]}\]$"):
        weights.held_weights({**drawn, name: [0.0] * shape[0]}, CONFIG)


def test_integer_weights_are_refused_as_not_floating_point():
    drawn = init_params(CONFIG, 0)
    first, second = list(drawn)[:2]
    drawn[first] = drawn[first].to(torch.int8)
    drawn[second] = drawn[second].to(torch.int32)
    with pytest.raises(InvalidConfig, match=rf"^weights: {first} is torch.int8, not a "
                                            r"floating-point parameter \(quantized weights "
                                            r"are not checked here\)$"):
        weights.held_weights(drawn, CONFIG)
    drawn[first] = drawn[first].to(torch.bfloat16)  # the twin: floating point, any dtype
    drawn[second] = drawn[second].to(torch.float16)
    assert weights.held_weights(drawn, CONFIG)[second].dtype == torch.float16


def test_weights_of_one_dtype_are_named_by_it_with_no_note():
    assert weights.dtypes_of({"a": torch.zeros(3, dtype=torch.bfloat16)}) == (
        torch.bfloat16, None)


def test_several_dtypes_are_named_by_the_one_most_elements_have_and_noted():
    held = {"big": torch.zeros(10, dtype=torch.bfloat16), "b1": torch.zeros(3),
            "b2": torch.zeros(3), "b3": torch.zeros(2, dtype=torch.float16),
            "b4": torch.zeros(1)}
    main, note = weights.dtypes_of(held)
    assert main == torch.bfloat16  # 10 elements, against fp32's 7 in three tensors
    assert note == ("your weights hold several dtypes: bfloat16, beside b1 float32, "
                    "b2 float32, b3 float16 and 1 more; each tensor is compared in its own "
                    "dtype")
    three = {n: held[n] for n in ("big", "b1", "b2", "b3")}
    assert weights.dtypes_of(three)[1] == (
        "your weights hold several dtypes: bfloat16, beside b1 float32, b2 float32, b3 "
        "float16; each tensor is compared in its own dtype")


def test_a_tie_in_elements_is_broken_by_the_dtypes_name_whatever_the_order():
    a = {"x": torch.zeros(4, dtype=torch.float16), "y": torch.zeros(4, dtype=torch.bfloat16)}
    b = dict(reversed(list(a.items())))
    assert weights.dtypes_of(a)[0] == weights.dtypes_of(b)[0] == torch.float16  # "torch.f" >


def test_a_threshold_on_real_weights_is_measured_at_the_smallest_sharded_degree_or_all():
    assert weights.threshold_ends(CONFIG) == ["plain:2"]
    assert weights.threshold_ends(CONFIG, every=True) == ["plain:2"]  # n_kv_heads 2
    kv4 = tiny(4, n_layers=1)
    assert weights.threshold_ends(kv4) == ["plain:2"]
    assert weights.threshold_ends(kv4, every=True) == ["plain:2", "plain:4"]


def test_the_worst_is_the_largest_deviation_of_every_end_at_every_seed(monkeypatch):
    """The forwards stand in: each end at each seed gives the reference's logits plus a
    known deviation; the worst is their largest, whichever end and seed it is at."""
    seen = []
    deviation = {("plain:2", 0): 0.125, ("plain:2", 1): -0.75, ("vllm:2", 0): 0.5,
                 ("vllm:2", 1): 0.0625}  # exact in fp32

    def convention_logits(ep, config, shards, tokens, *, phase, guard):
        seed = int(tokens[0, 0])  # stands for the seed: see tokens below
        params = {n: x for rank in shards[:1] for n, x in rank.items()}
        seen.append((str(ep), seed, phase, guard.bound))
        assert len(shards) == ep.world and params
        return reference[seed] + deviation[(str(ep), seed)]
    reference = {}

    class Reference:
        def __init__(self, config, params):
            self.routings = {}

        def __call__(self, tokens):
            reference[int(tokens[0, 0])] = torch.full((1, 2), float(tokens[0, 0]))
            return reference[int(tokens[0, 0])]
    monkeypatch.setattr(weights, "convention_logits", convention_logits)
    monkeypatch.setattr(weights, "ReferenceModel", Reference)
    monkeypatch.setattr(weights, "make_tokens", lambda config, seed: torch.full(
        (1, 1), seed - TOKEN_SEED_OFFSET))
    worst = weights.measure_worst(CONFIG, ["plain:2", "vllm:2"], seeds=range(2), phase="1b")
    assert worst == 0.75  # |-0.75|: the largest in size, at the second seed, the first end
    assert seen == [("plain:2", 0, "1b", float("inf")), ("vllm:2", 0, "1b", float("inf")),
                    ("plain:2", 1, "1b", float("inf")), ("vllm:2", 1, "1b", float("inf"))]
    assert weights.measure_worst(CONFIG, ["plain:2"], seeds=[0]) == 0.125
    assert seen[-1][2] == "1a"  # in process by default


def test_the_worst_forward_is_measured_on_the_weights_given_at_every_token_seed(monkeypatch):
    drawn = {n: (x * 1.5).to(torch.bfloat16) for n, x in init_params(CONFIG, 9).items()}
    params_seen, tokens_seen = [], []
    real = weights.ReferenceModel

    def reference(config, params):
        params_seen.append(params)
        return real(config, params)
    monkeypatch.setattr(weights, "ReferenceModel", reference)
    monkeypatch.setattr(weights, "make_tokens",
                        lambda config, seed: tokens_seen.append(seed) or make_tokens(config,
                                                                                      seed))
    worst = weights.measure_worst(CONFIG, ["plain:2"], seeds=[0, 3], weights=drawn)
    assert tokens_seen == [TOKEN_SEED_OFFSET, TOKEN_SEED_OFFSET + 3]
    assert all(p.keys() == drawn.keys() and all(
        p[n].dtype == torch.float32 and torch.equal(p[n], drawn[n].float()) for n in p)
        for p in params_seen)  # the weights' values, computed in fp32, at every seed
    assert worst > 0
    # without weights: each seed's own draws
    params_seen.clear()
    weights.measure_worst(CONFIG, ["plain:2"], seeds=[2])
    assert all(torch.equal(params_seen[0][n], x) for n, x in init_params(CONFIG, 2).items())


def test_measure_worst_is_the_declared_forwards_real_deviation():
    params = init_params(CONFIG, 0)
    tokens = make_tokens(CONFIG, TOKEN_SEED_OFFSET)
    from weight_sync_bench.check.floor import convention_logits
    from weight_sync_bench.conventions import materialize
    from weight_sync_bench.model.sharded import RoutingGuard

    model = ReferenceModel(CONFIG, params)
    expected = model(tokens)
    ep = endpoint("vllm:2")
    got = convention_logits(ep, CONFIG, materialize(ep.pieces(CONFIG), params), tokens,
                            phase="1a", guard=RoutingGuard(model.routings, float("inf")))
    assert weights.measure_worst(CONFIG, [ep], seeds=[0]) == float(
        (got - expected).abs().max())


def test_measure_threshold_derives_from_the_worst_it_was_asked_for(monkeypatch):
    asked = []
    monkeypatch.setattr(weights, "measure_worst",
                        lambda *a, **k: asked.append((a, k)) or 2.5e-7)
    held = init_params(CONFIG, 0)
    assert weights.measure_threshold(CONFIG, ["vllm:2"], [5], weights=held, phase="1b") == 1e-4
    assert asked == [((CONFIG, ["vllm:2"], [5]), dict(weights=held, phase="1b"))]
    weights.measure_threshold(CONFIG, ["vllm:2"])
    assert asked[-1] == ((CONFIG, ["vllm:2"], range(4)), dict(weights=None, phase="1a"))


@pytest.mark.parametrize("every,phase", [(False, "1a"), (True, "1b")])
def test_a_threshold_on_real_weights_is_measured_over_the_checks_ends_and_the_plain_ones(
        monkeypatch, every, phase):
    asked = []
    monkeypatch.setattr(weights, "measure_threshold",
                        lambda *a, **k: asked.append((a, k)) or 1e-3)
    held = init_params(tiny(4, n_layers=1), 0)
    kv4 = tiny(4, n_layers=1)
    got = weights.weights_threshold(kv4, ["megatron:2", "vllm:4"], held, None, phase,
                                    every=every)
    plain = ["plain:2", "plain:4"] if every else ["plain:2"]
    assert asked == [((kv4, ["megatron:2", "vllm:4", *plain]), dict(weights=held,
                                                                    phase=phase))]
    assert got == (1e-3, weights.measured_note(1e-3, every=every, phase=phase))


def test_a_given_threshold_is_used_as_given_and_nothing_is_measured(monkeypatch):
    monkeypatch.setattr(weights, "measure_threshold", lambda *a, **k: pytest.fail("measured"))
    assert weights.weights_threshold(CONFIG, ["vllm:2"], {}, 0.25) == (
        0.25, "your weights: the threshold was given")


def test_the_measured_note_says_which_degrees_and_where_the_forwards_ran():
    base = ("your weights: the threshold 0.001 was measured on them (the declared shards of "
            "the check's ends and of the plain layout at its ")
    assert weights.measured_note(1e-3) == (
        base + "smallest sharded degree, token seeds 1000-1003, 100x the worst)")
    assert weights.measured_note(1e-3, every=True, phase="1b") == (
        base + "sharded degrees, token seeds 1000-1003, 100x the worst, over gloo)")


def test_measure_worst_defaults_to_four_seeds_in_process(monkeypatch):
    seeds, phases = [], []
    tokens, logits = weights.make_tokens, weights.convention_logits
    monkeypatch.setattr(weights, "make_tokens",
                        lambda config, seed: seeds.append(seed) or tokens(config, seed))
    monkeypatch.setattr(weights, "convention_logits",
                        lambda *a, phase, **k: phases.append(phase) or logits(*a, phase=phase,
                                                                               **k))
    weights.measure_worst(CONFIG, ["plain:2"])
    assert seeds == [TOKEN_SEED_OFFSET + s for s in range(4)] and phases == ["1a"] * 4


def test_the_dtype_most_elements_have_counts_every_tensor_of_it():
    held = {"big": torch.zeros(5, dtype=torch.bfloat16), "a": torch.zeros(3),
            "b": torch.zeros(3)}
    assert weights.dtypes_of(held)[0] == torch.float32  # 6 elements in two tensors, not 3


def test_a_threshold_on_real_weights_defaults_to_in_process_at_the_smallest_degree(
        monkeypatch):
    asked = []
    monkeypatch.setattr(weights, "measure_threshold",
                        lambda *a, **k: asked.append((a, k)) or 1e-3)
    kv4 = tiny(4, n_layers=1)
    got = weights.weights_threshold(kv4, ["vllm:4"], {}, None)
    assert asked == [((kv4, ["vllm:4", "plain:2"]), dict(weights={}, phase="1a"))]
    assert got == (1e-3, weights.measured_note(1e-3))


def test_an_moe_models_worst_is_measured_with_the_references_routing_kept_nowhere():
    """The floor of the continuous part: the guard's bound is infinite, so every sharded
    forward takes the reference's choices, read from the reference's own routings."""
    from tests.sync.conftest import MOE_FEW

    worst = weights.measure_worst(MOE_FEW, ["plain:2"], seeds=[0])
    assert 0 <= worst < 1e-4
