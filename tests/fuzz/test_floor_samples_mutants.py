"""``fuzz.floor.samples`` (issue 30, the mutation pass over ``fuzz/floor/samples.py``): the loops
that measure the random-geometry floor (``random_floor_1a.json``, whose samples every fuzzed
check's threshold rule is derived from) and the replicated-KV validation
(``random_floor_1a_replicated_kv.json``, which admits a fuzzed conversion to vLLM past
``n_kv_heads``).

A sample measured on other weights or tokens than the fuzz's own (``domain.fuzz_params``,
``fuzz_tokens``), filed under the wrong degree or seed, with a scale that is not the largest
|reference logit|, a kill judged at the wrong degree or from the wrong source, an origin
mislabelled, or an artifact written with the wrong counts or domain is still a plausible
artifact: the rule derived from it is silently wrong. These tests pin every field of a sample
record (against the checker measured independently here, not against the loop's own output),
the arguments each loop passes on (the checker's and the artifact's, with the checker and the
artifact builders stood in to record them), the refusals' text, the progress reports, the
re-measures' one checker per (geometry, seed), and the replicated draw: the smallest and
largest replicated geometries first, every draw inside the domain, and the committed
validation's draw seed reproducing its committed geometries. Tiny geometries only: each real
forward here takes milliseconds, and nothing is written (the artifact builders are stood in)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from weight_sync_bench.check import floor as phase_floor
from weight_sync_bench.check.checker import Checker
from weight_sync_bench.check.conversion import ConversionChecker
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.conventions import CONVENTIONS, convert, endpoint
from weight_sync_bench.conventions import mutations as conversion_mutations
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.fuzz import case as fuzz_case
from weight_sync_bench.fuzz.domain import (
    DOMAIN,
    FuzzDomain,
    IntRange,
    fuzz_params,
    fuzz_tokens,
)
from weight_sync_bench.fuzz.floor import samples as S
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.tolerance import sampled

# 4 KV heads of one query head each: the plain layout at degrees 1, 2 and 4, the floor largest
# at 4 (0 at degree 1, where nothing is split)
PLAIN = DOMAIN.config(n_kv_heads=4, group=1, head_dim=4, d_model=16, ffn_per_kv_head=2,
                      vocab_per_kv_head=8, n_layers=1, batch=1, seq_len=4)
# 1 KV head, 4 query heads: vLLM stores it at t = 2 and 4 (the KV head replicated)
REPLICATED = DOMAIN.config(n_kv_heads=1, group=4, head_dim=4, d_model=16, ffn_per_kv_head=4,
                           vocab_per_kv_head=16, n_layers=1, batch=1, seq_len=8)
# 2 KV heads, 4 query heads: vLLM stores it at t = 4 only
TWO_KV = DOMAIN.config(n_kv_heads=2, group=2, head_dim=4, d_model=16, ffn_per_kv_head=4,
                       vocab_per_kv_head=16, n_layers=1, batch=1, seq_len=8)


def _same_tensors(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Recorder:
    """Stands in a constructor: records each call's arguments, then builds the real object
    (with ``phase`` forced to 1a, so a recorded phase can be any text)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, config, **kwargs):
        self.calls.append((config, kwargs))
        return self.real(config, **{**kwargs, "phase": "1a"})


def _forward_spy():
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        return inprocess_forward(*args, **kwargs)
    return forward, calls


def _assert_fuzz_checker(call, config, seed, forward, phase):
    got, kwargs = call
    assert got == config and kwargs["seed"] == seed and kwargs["threshold"] == math.inf
    assert kwargs["phase"] == phase and kwargs["forward"] is forward
    assert _same_tensors(kwargs["params"], fuzz_params(config, seed))
    assert _same_tensors(kwargs["tokens"], fuzz_tokens(config, seed))


def _reference_checker(config, seed):
    return Checker(config, seed=seed, threshold=math.inf, params=fuzz_params(config, seed),
                   tokens=fuzz_tokens(config, seed))


# --- relative_floor and sample: one geometry's floors ------------------------------------

def test_relative_floor_is_the_largest_floor_over_the_degrees_relative_to_the_logit_scale(
        monkeypatch):
    checker = _reference_checker(PLAIN, 5)
    scale = float(checker.reference.abs().max())
    floors = [checker.declared_error(t) for t in (1, 2, 4)]
    assert floors[0] == 0 < floors[1] < floors[2]  # the largest is the last degree's
    assert S.relative_floor(PLAIN, 5) == max(floors) / scale
    recorder = Recorder(Checker)
    monkeypatch.setattr(S, "Checker", recorder)
    forward, calls = _forward_spy()
    assert S.relative_floor(PLAIN, 5, forward=forward, phase="1b") == max(floors) / scale
    S.relative_floor(PLAIN, 5)
    (first, second) = recorder.calls
    _assert_fuzz_checker(first, PLAIN, 5, forward, "1b")
    _assert_fuzz_checker(second, PLAIN, 5, inprocess_forward, "1a")  # the defaults
    assert calls


def test_a_sample_is_one_record_per_degree_with_the_floor_scale_and_every_live_kill(
        monkeypatch):
    checker = _reference_checker(PLAIN, 5)
    scale = float(checker.reference.abs().max())
    records = S.sample(PLAIN, 5)
    assert [r["degree"] for r in records] == [1, 2, 4]
    for r, degree in zip(records, (1, 2, 4)):
        declared = checker.declared(degree)
        live = [m for m in MUTATIONS.values() if m.identity_reason(PLAIN, degree) is None]
        assert r == {"geometry": PLAIN.geometry(), "seed": 5, "degree": degree,
                     "scale": scale, "floor": checker.declared_error(degree),
                     "kills": {m.name: checker.verdict(m.apply(declared, checker.layout, PLAIN),
                                                       dst=degree).max_abs_error
                               for m in live}}
        assert list(r["kills"]) == [m.name for m in live]
        assert all(v > 0 for v in r["kills"].values())
    # at degree 1 fewer mutations are live than at 4 (nothing split there)
    assert set(records[0]["kills"]) < set(records[2]["kills"])
    assert records[2]["floor"] > records[1]["floor"] > 0 == records[0]["floor"]
    recorder = Recorder(Checker)
    monkeypatch.setattr(S, "Checker", recorder)
    forward, calls = _forward_spy()
    assert S.sample(PLAIN, 5, forward=forward, phase="1b") == records
    S.sample(PLAIN, 5)
    _assert_fuzz_checker(recorder.calls[0], PLAIN, 5, forward, "1b")
    _assert_fuzz_checker(recorder.calls[1], PLAIN, 5, inprocess_forward, "1a")
    assert calls


# --- measure_random: the random floor's artifact ----------------------------------------

SMALL_DOMAIN = dataclasses.replace(DOMAIN, d_model=IntRange(8, 64, 8), n_layers=IntRange(1, 2))


def _stand_in_measure(monkeypatch):
    sampled_calls, built = [], []

    def sample(config, seed, *, forward, phase):
        sampled_calls.append((config, seed, forward, phase))
        return [{"degree": 1, "seed": seed}, {"degree": 2, "seed": seed}]

    def artifact(samples, **kwargs):
        built.append((samples, kwargs))
        return {"artifact": len(built)}

    monkeypatch.setattr(S, "sample", sample)
    monkeypatch.setattr(S, "random_floor_artifact", artifact)
    return sampled_calls, built


def test_measure_random_labels_each_case_reports_progress_and_passes_the_artifact_its_figures(
        monkeypatch):
    sampled_calls, built = _stand_in_measure(monkeypatch)
    a, b, c = (DOMAIN.smallest(), PLAIN, TWO_KV)
    forward, _ = _forward_spy()
    out = list(S.measure_random(iter([(a, 1), (b, 2)]), phase="1b", forward=forward,
                                domain=SMALL_DOMAIN, searched=iter([(c, 3)]), profile="ci",
                                hypothesis_seed=11, search_examples=40))
    assert out[:3] == [S.SampleProgress(1, 3, a), S.SampleProgress(2, 3, b),
                       S.SampleProgress(3, 3, c)]
    assert out[3] == {"artifact": 1} and len(out) == 4
    assert sampled_calls == [(a, 1, forward, "1b"), (b, 2, forward, "1b"),
                             (c, 3, forward, "1b")]
    ((samples, kwargs),) = built
    assert samples == [{"degree": d, "seed": s, "origin": o}
                       for s, o in ((1, "random"), (2, "random"), (3, "search"))
                       for d in (1, 2)]
    assert kwargs == {"phase": "1b", "domain": SMALL_DOMAIN.to_json(), "geometries": 2,
                      "searched": 1, "search_examples": 40, "profile": "ci",
                      "hypothesis_seed": 11}


def test_measure_random_defaults_are_the_1a_phase_the_fuzz_domain_and_no_search(monkeypatch):
    sampled_calls, built = _stand_in_measure(monkeypatch)
    out = list(S.measure_random([(PLAIN, 4)]))
    assert out == [S.SampleProgress(1, 1, PLAIN), {"artifact": 1}]
    assert sampled_calls == [(PLAIN, 4, inprocess_forward, "1a")]
    ((samples, kwargs),) = built
    assert [s["origin"] for s in samples] == ["random", "random"]
    assert kwargs == {"phase": "1a", "domain": DOMAIN.to_json(), "geometries": 1,
                      "searched": 0, "search_examples": 0, "profile": None,
                      "hypothesis_seed": None}


def test_measure_random_refuses_the_first_case_outside_its_domain_naming_it_and_why(
        monkeypatch):
    sampled_calls, built = _stand_in_measure(monkeypatch)
    outside = PLAIN.replace(d_model=128, n_layers=3)  # inside DOMAIN, outside SMALL_DOMAIN
    run = S.measure_random([(PLAIN, 0)], domain=SMALL_DOMAIN, searched=[(outside, 1)])
    assert next(run) == S.SampleProgress(1, 2, PLAIN)
    with pytest.raises(ToleranceMismatch) as e:
        next(run)
    assert str(e.value) == ("floor sample 1 lies outside the fuzz domain: d_model=128 not in "
                            "8..64 step 8; n_layers=3 not in 1..2")
    assert len(sampled_calls) == 1 and not built


def test_measure_random_builds_the_artifact_from_real_samples():
    """Unstood: the samples the artifact records are ``sample``'s, each with its origin."""
    out = list(S.measure_random([(PLAIN, 5)], searched=[(DOMAIN.smallest(), 0)]))
    artifact = out[-1]
    assert artifact["samples"] == ([r | {"origin": "random"} for r in S.sample(PLAIN, 5)]
                                   + [r | {"origin": "search"}
                                      for r in S.sample(DOMAIN.smallest(), 0)])
    assert artifact["geometries"] == 1 and artifact["searched"] == 1


# --- remeasure_floors: a committed artifact's samples again -----------------------------

def _plain_samples():
    """Two degrees of PLAIN seed 5 (the second with its geometry's keys in another order),
    one of PLAIN seed 6, two of TWO_KV seed 5."""
    g, h = PLAIN.geometry(), TWO_KV.geometry()
    return [{"geometry": g, "seed": 5, "degree": 2},
            {"geometry": dict(reversed(list(g.items()))), "seed": 5, "degree": 4},
            {"geometry": g, "seed": 6, "degree": 4},
            {"geometry": h, "seed": 5, "degree": 1},
            {"geometry": h, "seed": 5, "degree": 2}]


def test_remeasure_floors_measures_each_sample_with_one_checker_per_geometry_and_seed(
        monkeypatch):
    samples = _plain_samples()
    want = [_reference_checker(PLAIN, 5).declared_error(2),
            _reference_checker(PLAIN, 5).declared_error(4),
            _reference_checker(PLAIN, 6).declared_error(4),
            _reference_checker(TWO_KV, 5).declared_error(1),
            _reference_checker(TWO_KV, 5).declared_error(2)]
    assert want[0] != want[1] != want[2] and want[4] > 0
    assert S.remeasure_floors({"phase": "1a", "samples": samples}) == want
    recorder = Recorder(Checker)
    monkeypatch.setattr(S, "Checker", recorder)
    forward, calls = _forward_spy()
    progress = []
    floors = S.remeasure_floors({"phase": "1b", "samples": samples}, forward=forward,
                                progress=lambda *a: progress.append(a))
    assert floors == want
    # one checker per (geometry, seed): the samples' degrees are adjacent
    assert [c.name for c, _ in recorder.calls] == ["floor-sample-0", "floor-sample-2",
                                                   "floor-sample-3"]
    for call, config, seed in zip(recorder.calls, (PLAIN, PLAIN, TWO_KV), (5, 6, 5)):
        _assert_fuzz_checker(call, config.replace(name=call[0].name), seed, forward, "1b")
    assert progress == [(i + 1, 5, f"sample d_model={s['geometry']['d_model']}")
                        for i, s in enumerate(samples)]
    assert calls
    recorder.calls.clear()
    S.remeasure_floors({"phase": "1a", "samples": samples[:1]})
    assert recorder.calls[0][1]["forward"] is inprocess_forward


# --- the replicated-KV draw --------------------------------------------------------------

def test_max_replicated_degree_is_the_domains_largest_n_heads():
    assert S.max_replicated_degree() == 16
    odd = dataclasses.replace(DOMAIN, n_kv_heads=IntRange(1, 6, 2), group=IntRange(2, 7))
    assert S.max_replicated_degree(odd) == 5 * 7


def test_the_replicated_draw_starts_with_the_smallest_and_the_largest_replicated_geometry():
    small = DOMAIN.config(n_kv_heads=1, group=2, head_dim=2, d_model=8, ffn_per_kv_head=2,
                          vocab_per_kv_head=8, n_layers=1, batch=1, seq_len=4)
    large = DOMAIN.config(n_kv_heads=4, group=4, head_dim=16, d_model=128, ffn_per_kv_head=32,
                          vocab_per_kv_head=256, n_layers=3, batch=2, seq_len=16)
    assert S.draw_replicated_geometries(1, 3) == [(small, 0)]
    assert S.draw_replicated_geometries(2, 3) == [(small, 0), (large, 0)]
    assert S.draw_replicated_geometries(3, 3)[:2] == [(small, 0), (large, 0)]
    # a domain whose group and ffn ranges hold no multiple of 4: k = 2 only
    narrow = dataclasses.replace(DOMAIN, group=IntRange(1, 3), ffn_per_kv_head=IntRange(3, 31),
                                 head_dim=IntRange(4, 10, 2), d_model=IntRange(16, 120, 8))
    drawn = S.draw_replicated_geometries(60, 3, narrow)
    assert drawn[:2] == [
        (narrow.config(n_kv_heads=1, group=2, head_dim=4, d_model=16, ffn_per_kv_head=4,
                       vocab_per_kv_head=8, n_layers=1, batch=1, seq_len=4), 0),
        (narrow.config(n_kv_heads=4, group=2, head_dim=10, d_model=120, ffn_per_kv_head=30,
                       vocab_per_kv_head=256, n_layers=3, batch=2, seq_len=16), 0)]
    assert all(narrow.contains(c) for c, _ in drawn)
    assert all(c.n_heads == 2 * c.n_kv_heads and (c.ffn // c.n_kv_heads) % 2 == 0
               for c, _ in drawn)
    # and one whose ffn range holds a multiple of 4 but whose group range holds none
    assert all(c.n_heads == 2 * c.n_kv_heads for c, _ in S.draw_replicated_geometries(
        30, 1, dataclasses.replace(DOMAIN, group=IntRange(1, 3))))
    # and one whose group range holds a multiple of 4 but whose ffn range holds none
    drawn = S.draw_replicated_geometries(30, 1, dataclasses.replace(
        DOMAIN, ffn_per_kv_head=IntRange(2, 3)))
    assert all(c.ffn == 2 * c.n_kv_heads for c, _ in drawn)
    assert drawn[1][0].n_heads == 4 * 4  # the largest group still, a multiple of k = 2


def test_the_draw_is_reproducible_inside_the_domain_of_its_size_with_every_variant():
    drawn = S.draw_replicated_geometries(120, 7)
    assert len(drawn) == 120 and drawn == S.draw_replicated_geometries(120, 7)
    assert drawn[2:] != S.draw_replicated_geometries(120, 8)[2:]
    assert all(DOMAIN.contains(c) for c, _ in drawn)
    rest = [c for c, _ in drawn[2:]]
    seeds = [s for _, s in drawn[2:]]
    assert all(s in DOMAIN.seed for s in seeds) and len(set(seeds)) > 100
    # k (2 or 4) first: the query group and the ffn per KV head are both multiples of it
    for c in rest:
        group, ffn = c.n_heads // c.n_kv_heads, c.ffn // c.n_kv_heads
        assert group % 2 == 0 and ffn % 2 == 0, c
    assert {c.n_heads // c.n_kv_heads for c in rest} == {2, 4}
    # every coordinate's range is reached, ends included
    for name, r in (("n_kv_heads", DOMAIN.n_kv_heads), ("n_layers", DOMAIN.n_layers),
                    ("batch", DOMAIN.batch)):
        assert {getattr(c, name) for c in rest} == set(range(r.lo, r.top + 1)), name
    assert {c.seq_len for c in rest} >= {4, 16} and {c.d_model for c in rest} >= {8, 128}
    assert {c.head_dim for c in rest} >= {2, 16}
    # the variants: no bias, a qkv bias (Qwen2), a qkv and an o_proj bias (attention_bias)
    assert {(c.qkv_bias, c.o_bias) for c in rest} == {(False, False), (True, False),
                                                       (True, True)}
    assert not any(c.bias for c in rest)
    tied = sum(c.tie_embeddings for c in rest)
    assert 30 < tied < 90  # half, as drawn


def test_the_committed_validations_draw_seed_reproduces_its_committed_geometries():
    """``random_floor_1a_replicated_kv.json`` records its draw seed and size: drawn again,
    the cases vLLM stores past ``n_kv_heads`` are its samples' geometries and seeds, in
    order (the first 20 draws: the draw is one stream, so they are the first 20 of its
    300)."""
    artifact = sampled.load_replicated_kv()
    drawn = S.draw_replicated_geometries(artifact["geometries"], artifact["draw_seed"])
    assert len(drawn) == artifact["geometries"]
    assert drawn[:20] == S.draw_replicated_geometries(20, artifact["draw_seed"])
    want = [(c.geometry(), s) for c, s in drawn[:20]
            for _ in phase_floor.replicated_degrees(c, artifact["max_degree"])]
    assert len(want) > 20
    assert [(x["geometry"], x["seed"]) for x in artifact["samples"][:len(want)]] == want
    assert (S.REPLICATED_GEOMETRIES, S.REPLICATED_SEED) == (artifact["geometries"],
                                                            artifact["draw_seed"])


# --- sample_replicated_kv: vLLM's forward at each replicated degree ---------------------

@dataclasses.dataclass(frozen=True)
class Planted:
    """A stand-in conversion mutation: applies where ``applies(src)`` (the source endpoint's
    text) holds, the identity where ``identity(src)`` holds; it adds ``1 + the source's
    index`` to every stored tensor, so the deviation shows which source it was applied
    from."""

    name: str
    applies: object = lambda src: True
    identity: object = lambda src: False
    min_seq_len: int = 0
    seen: list = dataclasses.field(default_factory=list)

    def not_applicable(self, conversion):
        return None if self.applies(str(conversion.src)) else "no"

    def identity_reason(self, conversion):
        return "same" if self.identity(str(conversion.src)) else None

    def apply(self, shards, conversion):
        self.seen.append((str(conversion.src), str(conversion.dst)))
        return _shifted(shards, conversion.src, conversion.config)


def _sources(config):
    return [endpoint(f"{n}:{t}") for n, c in CONVENTIONS.items()
            for t in c.supported_degrees(config, 16)]


def _shifted(shards, src, config):
    shift = 1.0 + [str(e) for e in _sources(config)].index(str(src))
    return [{k: v + shift for k, v in s.items()} for s in shards]


def test_a_replicated_sample_judges_each_mutation_from_the_first_source_it_is_live_from(
        monkeypatch):
    planted = {
        "at_9_tokens": Planted("at_9_tokens", min_seq_len=9),  # skipped: the rest still run
        "everywhere": Planted("everywhere"),  # from the first source, plain:1
        "megatron_only": Planted("megatron_only", applies=lambda s: s.startswith("megatron")),
        "not_megatron_1": Planted("not_megatron_1", applies=lambda s: s.startswith("megatron"),
                                  identity=lambda s: s == "megatron:1"),
        "never": Planted("never", applies=lambda s: False),
        "identity": Planted("identity", identity=lambda s: True),
        "at_8_tokens": Planted("at_8_tokens", min_seq_len=8),  # REPLICATED has 8
    }
    monkeypatch.setattr(conversion_mutations, "MUTATIONS", planted)
    made, real = [], fuzz_case.make_checker

    def make_checker(config, seed, **kwargs):  # records the threshold the measurement ran under
        made.append((config, seed, kwargs["threshold_rule"](config, torch.tensor([1.0]))))
        return real(config, seed, **kwargs)

    monkeypatch.setattr(fuzz_case, "make_checker", make_checker)
    records = S.sample_replicated_kv(REPLICATED, 7)
    assert made == [(REPLICATED, 7, math.inf)]  # a measurement never refuses: threshold inf
    monkeypatch.setattr(fuzz_case, "make_checker", real)
    checker = ConversionChecker(fuzz_case.make_checker(REPLICATED, 7,
                                                       threshold_rule=lambda c, r: math.inf))
    scale = float(checker.checker.reference.abs().max())
    assert [r["degree"] for r in records] == [2, 4]
    srcs = _sources(REPLICATED)
    assert [str(e) for e in srcs] == ["plain:1", "megatron:1", "megatron:2", "megatron:4",
                                      "vllm:1", "vllm:2", "vllm:4", "hf:1", "meta:1"]
    first = {"everywhere": "plain:1", "megatron_only": "megatron:1",
             "not_megatron_1": "megatron:2", "at_8_tokens": "plain:1"}
    for name, p in planted.items():  # each applied once per degree, from its first source
        assert p.seen == [(first[name], f"vllm:{t}") for t in (2, 4)] if name in first \
            else not p.seen, name
    for r, t in zip(records, (2, 4)):
        dst = endpoint(f"vllm:{t}")
        kills = {name: checker.error(dst, _shifted(
                     convert(checker.source(endpoint(src)), endpoint(src), dst, REPLICATED),
                     src, REPLICATED))
                 for name, src in first.items()}
        assert r == {"geometry": REPLICATED.geometry(), "seed": 7, "degree": t,
                     "forward": phase_floor.REPLICATED_KV, "scale": scale,
                     "floor": checker.declared_error(dst), "kills": kills}
        assert list(r["kills"]) == list(first) and r["floor"] > 0
        assert len({round(v, 3) for v in kills.values()}) == 3  # the sources tell apart


def test_a_replicated_sample_reaches_the_domains_largest_degree_16(monkeypatch):
    """16 query heads over 4 KV heads: vLLM stores it at t = 8 and 16, the domain's largest
    n_heads (``max_replicated_degree``), past ``check.floor``'s default of 8."""
    wide = DOMAIN.config(n_kv_heads=4, group=4, head_dim=2, d_model=8, ffn_per_kv_head=4,
                         vocab_per_kv_head=8, n_layers=1, batch=1, seq_len=4)
    monkeypatch.setattr(conversion_mutations, "MUTATIONS", {})
    records = S.sample_replicated_kv(wide, 0)
    assert [r["degree"] for r in records] == [8, 16]
    assert all(r["kills"] == {} and r["forward"] == phase_floor.REPLICATED_KV for r in records)
    # a smaller domain's largest degree bounds the sample (a measurement over that domain)
    assert [r["degree"] for r in S.sample_replicated_kv(wide, 0, 8)] == [8]


def test_a_replicated_samples_kills_are_the_real_mutations_deviations():
    (record,) = S.sample_replicated_kv(TWO_KV, 3)
    checker = ConversionChecker(fuzz_case.make_checker(TWO_KV, 3,
                                                       threshold_rule=lambda c, r: math.inf))
    dst = endpoint("vllm:4")
    assert record["floor"] == checker.declared_error(dst) and record["degree"] == 4
    src = endpoint("plain:1")  # the first source, where kv_replica_modulo applies
    conversion = conversion_mutations.Conversion(TWO_KV, src, dst)
    m = conversion_mutations.MUTATIONS["kv_replica_modulo"]
    assert m.not_applicable(conversion) is None and m.identity_reason(conversion) is None
    out = m.apply(convert(checker.source(src), src, dst, TWO_KV), conversion)
    assert record["kills"]["kv_replica_modulo"] == checker.error(dst, out) > 1


# --- measure_replicated_kv: the validation's artifact -----------------------------------

def test_measure_replicated_kv_refuses_another_phase_an_outside_case_and_no_sample():
    with pytest.raises(ToleranceMismatch) as e:
        S.measure_replicated_kv([(TWO_KV, 0)], phase="1b")
    assert str(e.value) == "conversions are fuzzed in process (phase 1a), got '1b'"
    with pytest.raises(ToleranceMismatch) as e:
        S.measure_replicated_kv([(TWO_KV, 0), (TWO_KV.replace(d_model=136, seq_len=3), 0)])
    assert str(e.value) == ("replicated-KV sample 1 lies outside the fuzz domain: d_model=136 "
                            "not in 8..128 step 8; seq_len=3 not in 4..16")
    with pytest.raises(ToleranceMismatch) as e:  # one KV head per query head: t <= n_kv
        S.measure_replicated_kv([(PLAIN, 0), (DOMAIN.smallest(), 1)])
    assert str(e.value) == ("no replicated-KV sample: no case is stored by vLLM past "
                            "n_kv_heads")


def test_measure_replicated_kv_passes_every_sample_and_its_figures_to_the_artifact(
        monkeypatch):
    calls, built, progress = [], [], []

    def sample(config, seed, max_degree):
        calls.append((config, seed, max_degree))
        return [{"d": config.d_model, "seed": seed}]

    def artifact(samples, **kwargs):
        built.append((samples, kwargs))
        return {"built": True}

    monkeypatch.setattr(S, "sample_replicated_kv", sample)
    monkeypatch.setattr(S, "replicated_kv_artifact", artifact)
    domain = dataclasses.replace(DOMAIN, n_kv_heads=IntRange(1, 2), group=IntRange(1, 3))
    cases = iter([(TWO_KV, 4), (REPLICATED.replace(n_heads=3, ffn=3), 9)])
    assert S.measure_replicated_kv(cases, domain=domain, seed=77,
                                   progress=lambda *a: progress.append(a)) == {"built": True}
    # each sample measured up to the domain's largest degree, the one the artifact records
    assert calls == [(TWO_KV, 4, 6), (REPLICATED.replace(n_heads=3, ffn=3), 9, 6)]
    ((samples, kwargs),) = built
    assert samples == [{"d": 16, "seed": 4}, {"d": 16, "seed": 9}]
    assert kwargs == {"phase": "1a", "forward": phase_floor.REPLICATED_KV,
                      "domain": domain.to_json(), "geometries": 2, "draw_seed": 77,
                      "max_degree": 6}
    assert progress == [(1, 2, "geometry d_model=16 kv_heads=2"),
                        (2, 2, "geometry d_model=16 kv_heads=1")]
    built.clear()
    S.measure_replicated_kv([(TWO_KV, 4)])  # the defaults: the fuzz domain, no draw seed
    assert built[0][1]["domain"] == DOMAIN.to_json() and built[0][1]["draw_seed"] is None
    assert built[0][1]["max_degree"] == 16


# --- remeasure_replicated_floors and config_of ------------------------------------------

def test_remeasure_replicated_floors_uses_one_checker_per_geometry_and_seed(monkeypatch):
    def floor(config, seed, t):
        checker = ConversionChecker(fuzz_case.make_checker(
            config, seed, threshold_rule=lambda c, r: math.inf))
        return checker.declared_error(endpoint(f"vllm:{t}"))

    # three floors of one geometry, all different, so each result is seen to be its sample's:
    # which seeds give that depends on the CPU (on an AMD EPYC seed 1 rounds alike at t=2, 4)
    biased = REPLICATED.replace(qkv_bias=True)
    one = next(s for s in range(1, 20) if floor(biased, s, 2) != floor(biased, s, 4))
    two = next(s for s in range(one + 1, 40)
               if floor(biased, s, 4) not in (floor(biased, one, 2), floor(biased, one, 4)))
    g, h = biased.geometry(), TWO_KV.geometry()
    samples = [{"geometry": g, "seed": one, "degree": 2},
               {"geometry": dict(reversed(list(g.items()))), "seed": one, "degree": 4},
               {"geometry": g, "seed": two, "degree": 4},
               {"geometry": h, "seed": 5, "degree": 4}]
    want = [floor(biased, one, 2), floor(biased, one, 4), floor(biased, two, 4),
            floor(TWO_KV, 5, 4)]
    assert len(set(want[:3])) == 3
    made = []
    real = fuzz_case.make_checker

    def make_checker(config, seed, *, threshold_rule):
        made.append((config, seed, threshold_rule(config, torch.tensor([1.0]))))
        return real(config, seed, threshold_rule=threshold_rule)

    monkeypatch.setattr(fuzz_case, "make_checker", make_checker)
    progress = []
    assert S.remeasure_replicated_floors({"samples": samples},
                                         progress=lambda *a: progress.append(a)) == want
    assert made == [(biased.replace(name="replicated-sample-0"), one, math.inf),
                    (biased.replace(name="replicated-sample-2"), two, math.inf),
                    (TWO_KV.replace(name="replicated-sample-3"), 5, math.inf)]
    assert progress == [(1, 4, "sample t=2"), (2, 4, "sample t=4"), (3, 4, "sample t=4"),
                        (4, 4, "sample t=4")]
    made.clear()
    assert S.remeasure_replicated_floors({"samples": samples[:1]}) == want[:1] and made


def test_config_of_reads_a_recorded_geometrys_variants_back_as_bools():
    config = REPLICATED.replace(qkv_bias=True, o_bias=True, tie_embeddings=True,
                                vocab_multiple=64)
    geometry = config.geometry()
    assert geometry["qkv_bias"] == 1 and geometry["vocab_multiple"] == 64
    back = S.config_of(geometry, "read")
    assert back == config.replace(name="read") and back.name == "read"
    assert back.qkv_bias is True and back.o_bias is True and back.tie_embeddings is True
    assert back.vocab_multiple == 64 and type(back.vocab_multiple) is int
    assert type(back.d_model) is int and isinstance(back, ModelConfig)
    plain = S.config_of({**REPLICATED.geometry(), "qkv_bias": 0}, "x")
    assert plain.qkv_bias is False and plain == REPLICATED.replace(name="x")


def test_the_fuzz_domain_is_this_modules_default():
    assert isinstance(DOMAIN, FuzzDomain) and S.DOMAIN is DOMAIN
    assert S.REPLICATION == (2, 4)
