"""The corpus module's exact behaviour, pinned where mutation testing (issue 10, item 5) found
it unpinned: every validation branch of ``case_from`` / ``_conversion_case_from`` with its
exact message and typed ``path`` / ``field``, the footprint limit at and just past its
boundary, the entry ``make_entry`` builds field by field, the name ``entry_name`` hashes,
``write_entry``'s atomic write, ``replay``'s dispatch and ``format_replay``'s table text.

Pure Python and fast: no training, no gloo; the few cases run are the smallest geometry with
a fixed threshold rule. Every file goes under ``tmp_path``."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import mutation_by_name
from weight_sync_bench.conventions.mutations import (
    mutation_by_name as conversion_mutation,
)
from weight_sync_bench.errors import (
    CorpusEntryTooLarge,
    CorruptCorpusEntry,
    InvalidConfig,
    InvalidNumber,
    UnknownMutation,
)
from weight_sync_bench.fuzz import corpus
from weight_sync_bench.fuzz.case import (
    Case,
    ConversionCase,
    Outcome,
)
from weight_sync_bench.fuzz.corpus import (
    GIB,
    KIND,
    Entry,
    Replayed,
    ReplayLimits,
    _field,
    _num,
    case_from,
    entry_name,
    entry_paths,
    format_replay,
    load_corpus,
    load_entry,
    make_entry,
    scan_corpus,
    versions,
    write_entry,
)
from weight_sync_bench.fuzz.domain import DOMAIN
from weight_sync_bench.fuzz.replay import replay
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.model.footprint import Footprint, footprint

# the smallest geometry with two kv heads: layout degrees 1 and 2; cost 60160 B, 1813536 flops
G = {"vocab": 16, "d_model": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "head_dim": 2,
     "ffn": 4, "batch": 1, "seq_len": 4}
class _Drop:
    """The field is removed, not set (a stable repr: test ids must be the same in every
    xdist worker)."""

    def __repr__(self) -> str:
        return "DROP"


DROP = _Drop()


def _layout_entry() -> dict:
    return {
        "schema": 1, "kind": KIND, "property": "invariant", "origin": "seeded",
        "case": {"geometry": dict(G), "degrees": {"src": 1, "dst": 2},
                 "seeds": {"param": 0, "token": 1000}, "mutation": "lm_head_reversed",
                 "phase": "1a"},
        "measured": {"deviation": 0.5, "threshold": 0.001, "ratio": 500.0,
                     "worst_deviation_before_shrinking": 0.5,
                     "worst_ratio_before_shrinking": 500.0},
        "found": {"versions": {"torch": "t", "numpy": "n", "hypothesis": None, "python": "p",
                               "platform": "x"},
                  "commit": None, "src_dirty": None, "profile": None, "hypothesis_seed": None,
                  "date": "2026-01-01T00:00:00Z"},
    }


def _conversion_entry() -> dict:
    entry = _layout_entry()
    entry["property"], entry["origin"] = "convert", "discovered"
    entry["case"]["mutation"] = None
    entry["case"]["conventions"] = {"src": "plain", "dst": "meta"}
    return entry


def _edit(entry: dict, dotted: str, value: object) -> dict:
    entry = copy.deepcopy(entry)
    *parents, last = dotted.split(".")
    node = entry
    for part in parents:
        node = node[part]
    if value is DROP:
        del node[last]
    else:
        node[last] = value
    return entry


def _write(path: Path, data: object) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _config(name: str = "corpus:e", **changes: int) -> ModelConfig:
    return ModelConfig(name=name, **(G | changes))


# --- _field, _num ------------------------------------------------------------------------


def test_field_walks_the_dotted_path_and_names_a_missing_or_mistyped_field():
    p = Path("/x/e.json")
    assert _field({"a": {"b": 3}}, "a.b", int, p) == 3
    assert _field({"a": True}, "a", (int, bool), p) is True  # bool allowed where asked for
    assert _field({"a": False}, "a", bool, p) is False
    assert _field({"a": None}, "a", (str, type(None)), p) is None
    cases = [({}, "a.b", int, "missing field 'a.b'"),
             ({"a": 5}, "a.b", int, "missing field 'a.b'"),  # a parent that is no dict
             ({"a": "x"}, "a", int, "field 'a' is 'x', expected int"),
             ({"a": True}, "a", int, "field 'a' is True, expected int"),  # a bool is no int
             ({"a": 5}, "a", (str, type(None)), "field 'a' is 5, expected str or NoneType"),
             ({"a": None}, "a", (int, float, str),
              "field 'a' is None, expected int or float or str")]
    for data, dotted, kind, message in cases:
        with pytest.raises(CorruptCorpusEntry) as err:
            _field(data, dotted, kind, p)
        assert str(err.value) == f"{p}: {message}"
        assert (err.value.path, err.value.field) == (str(p), dotted)


def test_num_writes_only_non_finite_numbers_as_strings():
    assert _num(1.5) == 1.5 and _num(0.0) == 0.0
    assert (_num(float("inf")), _num(float("-inf")), _num(float("nan"))) == ("inf", "-inf", "nan")


# --- case_from: every field's validation, with its exact message --------------------------

UNKNOWN_LAYOUT = ""
UNKNOWN_CONVERSION = ""
try:
    mutation_by_name("kv_swap")
except UnknownMutation as exc:
    UNKNOWN_LAYOUT = str(exc)
try:
    conversion_mutation("kv_swapped")  # a layout mutation is not a conversion's
except UnknownMutation as exc:
    UNKNOWN_CONVERSION = str(exc)

SEEDS = "in 0..2^63-1"
CONVENTION_NAMES = "plain, megatron, vllm, hf, meta"
LAYOUT_ERRORS = [
    ("schema", DROP, "schema", "missing field 'schema'"),
    ("schema", "1", "schema", "field 'schema' is '1', expected int"),
    ("schema", True, "schema", "field 'schema' is True, expected int"),
    ("schema", 2, "schema", "field 'schema' is 2, this code reads 1"),
    ("property", 5, "property", "field 'property' is 5, expected str"),
    ("property", "bogus", "property",
     "field 'property' is 'bogus', expected one of invariant, kill, convert, convert_kill, "
     "moe_convert, moe_convert_kill"),
    ("case.geometry.vocab", DROP, "case.geometry.vocab", "missing field 'case.geometry.vocab'"),
    ("case.geometry.d_model", 8.0, "case.geometry.d_model",
     "field 'case.geometry.d_model' is 8.0, expected int"),
    ("case.geometry.seq_len", True, "case.geometry.seq_len",
     "field 'case.geometry.seq_len' is True, expected int"),
    ("case.geometry.bias", "yes", "case.geometry.bias",
     "field 'case.geometry.bias' is 'yes', expected int"),
    ("case.geometry.tie_embeddings", True, "case.geometry.tie_embeddings",
     "field 'case.geometry.tie_embeddings' is True, expected int"),  # variants are 0/1 ints
    ("case.geometry.vocab_multiple", 1.5, "case.geometry.vocab_multiple",
     "field 'case.geometry.vocab_multiple' is 1.5, expected int"),
    ("case.conventions", 5, "case.conventions", "field 'case.conventions' is 5, expected dict"),
    ("case.geometry.head_dim", 3, "case.geometry",
     "field 'case.geometry': corpus:e: RoPE needs an even head_dim (head_dim=3)"),
    ("case.geometry.n_heads", 3, "case.geometry",
     ("field 'case.geometry': corpus:e: GQA needs n_heads % n_kv_heads == 0 "
      "(n_heads=3, n_kv_heads=2)")),
    ("case.geometry.vocab_multiple", 0, "case.geometry",
     "field 'case.geometry': corpus:e: vocab_multiple must be a positive int, got 0"),
    ("case.mutation", DROP, "case.mutation", "missing field 'case.mutation'"),
    ("case.mutation", 5, "case.mutation", "field 'case.mutation' is 5, expected str or NoneType"),
    ("case.mutation", "kv_swap", "case.mutation", f"field 'case.mutation': {UNKNOWN_LAYOUT}"),
    ("case.mutation", "rope_permute_twice", "case.mutation",  # a conversion's, on a layout
     "field 'case.mutation': " + UNKNOWN_LAYOUT.replace("'kv_swap'", "'rope_permute_twice'")),
    ("case.phase", DROP, "case.phase", "missing field 'case.phase'"),
    ("case.phase", 1, "case.phase", "field 'case.phase' is 1, expected str"),
    ("case.phase", "2", "case.phase", "field 'case.phase' is '2', expected one of 1a, 1b"),
    ("case.seeds.param", DROP, "case.seeds.param", "missing field 'case.seeds.param'"),
    ("case.seeds.param", "0", "case.seeds.param",
     "field 'case.seeds.param' is '0', expected int"),
    ("case.seeds.param", -1, "case.seeds.param",
     f"field 'case.seeds.param' is -1, expected a seed {SEEDS}"),
    ("case.seeds.param", 2**63, "case.seeds.param",
     f"field 'case.seeds.param' is {2**63}, expected a seed {SEEDS}"),
    ("case.seeds.token", DROP, "case.seeds.token", "missing field 'case.seeds.token'"),
    ("case.seeds.token", 1000.0, "case.seeds.token",
     "field 'case.seeds.token' is 1000.0, expected int"),
    ("case.seeds", {"param": 5, "token": 5}, "case.seeds.token",
     "field 'case.seeds.token' is 5, this code draws tokens from 1000 + param = 1005"),
    ("case", _layout_entry()["case"] | {"mutation": None,
                                        "conventions": {"src": "plain", "dst": "meta"}},
     "case.conventions",
     "field 'case.conventions' is set, but property 'invariant' is not a conversion's"),
    ("property", "convert", "case.conventions",
     "field 'case.conventions' is missing: property 'convert' is a conversion's"),
    ("case.degrees.src", DROP, "case.degrees.src", "missing field 'case.degrees.src'"),
    ("case.degrees.src", "1", "case.degrees.src", "field 'case.degrees.src' is '1', expected int"),
    ("case.degrees.src", 3, "case.degrees.src",
     "field 'case.degrees.src' is 3, the geometry supports t in [1, 2]"),
    ("case.degrees.dst", 4, "case.degrees.dst",
     "field 'case.degrees.dst' is 4, the geometry supports t in [1, 2]"),
    ("origin", "planted", "origin",
     "field 'origin' is 'planted', expected one of seeded, discovered"),
    ("measured.deviation", DROP, "measured.deviation", "missing field 'measured.deviation'"),
    ("measured.deviation", None, "measured.deviation",
     "field 'measured.deviation' is None, expected int or float or str"),
    ("found.versions", DROP, "found.versions", "missing field 'found.versions'"),
    ("found.versions", "2.4", "found.versions", "field 'found.versions' is '2.4', expected dict"),
]
CONVERSION_ERRORS = [
    ("case.conventions.src", "nope", "case.conventions.src",
     f"field 'case.conventions.src' is 'nope', expected one of {CONVENTION_NAMES} (or a "
     "whole endpoint, megatron:tp=2,ep=4)"),
    ("case.conventions.dst", DROP, "case.conventions.dst",
     f"field 'case.conventions.dst' is None, expected one of {CONVENTION_NAMES} (or a "
     "whole endpoint, megatron:tp=2,ep=4)"),
    ("case.degrees.src", DROP, "case.degrees.src", "missing field 'case.degrees.src'"),
    ("case.degrees.dst", "2", "case.degrees.dst", "field 'case.degrees.dst' is '2', expected int"),
    ("case.conventions.dst", "hf", "case.degrees.dst",
     "field 'case.degrees.dst' is 2, hf stores the geometry at t in [1]"),
    ("case.degrees.src", 4, "case.degrees.src",
     "field 'case.degrees.src' is 4, plain stores the geometry at t in [1, 2]"),
    ("case.mutation", "kv_swapped", "case.mutation",
     f"field 'case.mutation': {UNKNOWN_CONVERSION}"),
    ("property", "invariant", "case.conventions",
     "field 'case.conventions' is set, but property 'invariant' is not a conversion's"),
]


def _check_error(path: Path, data: object, field: str | None, message: str) -> None:
    _write(path, data)
    with pytest.raises(CorruptCorpusEntry) as err:
        load_entry(path)
    assert type(err.value) is CorruptCorpusEntry
    assert str(err.value) == f"{path}: {message}"
    assert (err.value.path, err.value.field) == (str(path), field)


@pytest.mark.parametrize("dotted, value, field, message", LAYOUT_ERRORS,
                         ids=[f"{d}={v!r}"[:40] for d, v, *_ in LAYOUT_ERRORS])
def test_a_bad_layout_entry_names_its_file_and_field_exactly(tmp_path, dotted, value, field,
                                                              message):
    _check_error(tmp_path / "e.json", _edit(_layout_entry(), dotted, value), field, message)


@pytest.mark.parametrize("dotted, value, field, message", CONVERSION_ERRORS,
                         ids=[f"{d}={v!r}"[:40] for d, v, *_ in CONVERSION_ERRORS])
def test_a_bad_conversion_entry_names_its_file_and_field_exactly(tmp_path, dotted, value, field,
                                                                  message):
    _check_error(tmp_path / "e.json", _edit(_conversion_entry(), dotted, value), field, message)


def test_a_conversion_listing_its_degrees_lists_them_up_to_16(tmp_path):
    """17 kv heads: plain stores it at t in 1 and 17, and the message lists 1..16 only."""
    g17 = {"vocab": 136, "n_heads": 17, "n_kv_heads": 17, "ffn": 34}
    data = _conversion_entry()
    data["case"]["geometry"] |= g17
    data["case"]["degrees"] = {"src": 2, "dst": 1}
    _check_error(tmp_path / "e.json", data, "case.degrees.src",
                 "field 'case.degrees.src' is 2, plain stores the geometry at t in [1]")


def test_a_conversion_the_case_itself_refuses_names_the_case(tmp_path):
    path = tmp_path / "e.json"
    with pytest.raises(InvalidConfig) as why:
        ConversionCase(_config(), "plain", 1, "meta", 2, 0, None, "1b")
    _check_error(path, _edit(_conversion_entry(), "case.phase", "1b"), "case",
                 f"field 'case': {why.value}")


def test_not_json_and_unreadable_files_name_the_file(tmp_path):
    text = "{not json"
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        decode = str(exc)
    _check_error(tmp_path / "e.json", text, None, f"not valid JSON ({decode})")
    missing = tmp_path / "nope.json"
    with pytest.raises(CorruptCorpusEntry) as err:
        load_entry(missing)
    assert str(err.value) == f"{missing}: cannot be read (No such file or directory)"
    assert (err.value.path, err.value.field) == (str(missing), None)
    with pytest.raises(CorruptCorpusEntry) as err:
        load_entry(tmp_path)
    assert str(err.value) == f"{tmp_path}: a directory, not a regular file"
    assert err.value.path == str(tmp_path)
    fifo = tmp_path / "fifo.json"  # opened non-blocking: refused, never waited on
    os.mkfifo(fifo)
    with pytest.raises(CorruptCorpusEntry) as err:
        load_entry(fifo)
    assert str(err.value) == f"{fifo}: a FIFO (named pipe), not a regular file"


def test_a_layout_entry_loads_as_exactly_its_case(tmp_path):
    data = _layout_entry()
    data["case"] |= {"degrees": {"src": 2, "dst": 1}, "seeds": {"param": 5, "token": 1005},
                     "mutation": "kv_swapped", "phase": "1b"}
    entry = load_entry(_write(tmp_path / "e.json", data))
    assert entry.case == Case(_config(), src=2, dst=1, seed=5, mutation="kv_swapped", phase="1b")
    assert entry.path == tmp_path / "e.json" and entry.data == data
    top = InvalidNumber.SEED_MAX  # the largest seed is a seed
    data["case"]["seeds"] = {"param": top, "token": 1000 + top}
    assert load_entry(_write(tmp_path / "e.json", data)).case.seed == top
    assert case_from(data, tmp_path / "e.json").seed == top


def test_variant_fields_load_as_int_and_bools(tmp_path):
    data = _layout_entry()
    data["case"]["geometry"] |= {"vocab_multiple": 4, "tie_embeddings": 1, "qkv_bias": 1,
                                 "o_bias": 0}
    config = load_entry(_write(tmp_path / "e.json", data)).case.config
    assert config == _config(vocab_multiple=4, tie_embeddings=True, qkv_bias=True)
    assert config.vocab_multiple == 4 and type(config.vocab_multiple) is int
    assert config.tie_embeddings is True and config.qkv_bias is True
    assert config.o_bias is False and config.bias is False
    data["case"]["geometry"] |= {"vocab_multiple": 1, "tie_embeddings": 0, "bias": 2}
    config = load_entry(_write(tmp_path / "e.json", data)).case.config
    assert (config.vocab_multiple, config.tie_embeddings, config.bias) == (1, False, True)


def test_a_conversion_entry_loads_as_exactly_its_case(tmp_path):
    data = _edit(_conversion_entry(), "case.seeds", {"param": 3, "token": 1003})
    entry = load_entry(_write(tmp_path / "e.json", data))
    assert entry.case == ConversionCase(_config(), "plain", 1, "meta", 2, seed=3)
    data = _edit(data, "case.mutation", "rope_permute_twice")
    data["property"] = "convert_kill"
    data["case"]["degrees"] = {"src": 1, "dst": 1}
    entry = load_entry(_write(tmp_path / "e.json", data))
    assert entry.case == ConversionCase(_config(), "plain", 1, "meta", 1, seed=3,
                                        mutation="rope_permute_twice", phase="1a")


# --- the footprint limit ------------------------------------------------------------------

COST = footprint(_config())  # 60160 bytes, 1813536 flops


def test_replay_limits_name_the_bad_limit():
    assert (ReplayLimits().max_bytes, ReplayLimits().max_flops) == (2 * GIB, 50e9)
    with pytest.raises(InvalidNumber, match=r"^max_bytes must be a finite number > 0, got 0$"):
        ReplayLimits(max_bytes=0)
    with pytest.raises(InvalidNumber, match=r"^max_flops must be a finite number > 0, got nan$"):
        ReplayLimits(max_flops=float("nan"))


def test_the_footprint_limit_holds_at_the_boundary_and_refuses_just_past_it(tmp_path):
    data, path = _layout_entry(), tmp_path / "e.json"
    assert (COST.bytes, COST.flops) == (60160, 1813536)
    exact = ReplayLimits(max_bytes=COST.bytes, max_flops=COST.flops)
    assert case_from(data, path, exact).config == _config()
    for limits, over in [(ReplayLimits(COST.bytes - 1, COST.flops), "bytes"),
                         (ReplayLimits(COST.bytes, COST.flops - 1), "flops")]:
        with pytest.raises(CorpusEntryTooLarge) as err:
            case_from(data, path, limits)
        assert ("GiB" in str(err.value), "GFLOP" in str(err.value)) == (over == "bytes",
                                                                         over == "flops")


def test_an_entry_inside_the_domain_over_tight_limits_is_refused_naming_the_geometry(tmp_path):
    path = _write(tmp_path / "e.json", _layout_entry())
    with pytest.raises(CorpusEntryTooLarge) as err:
        load_entry(path, ReplayLimits(max_bytes=1000, max_flops=1000))
    assert str(err.value) == (
        f"{path}: field 'case.geometry' is inside the fuzz domain: replaying this entry would "
        "need about 5.6e-05 GiB (limit 9.31e-07 GiB; raise it with --max-gib) and about "
        "0.00181 GFLOP (limit 1e-06 GFLOP; raise it with --max-gflop), refused before "
        "allocating anything (estimate: 4 B x (4 x 532 parameters + 624 activations) + 4 x 12 "
        "tensors x 1024 B, 1.81e+06 flops; see model.footprint)")
    assert (err.value.path, err.value.field) == (str(path), "case.geometry")
    assert (err.value.estimate, err.value.flops) == (60160, 1813536)


def test_the_domains_largest_geometry_is_inside_it(tmp_path):
    """Every field at the top of its range (ratio exactly 1): no field lies outside."""
    data = _edit(_layout_entry(), "case.geometry", DOMAIN.largest().geometry())
    data["case"]["degrees"] = {"src": 1, "dst": 4}
    with pytest.raises(CorpusEntryTooLarge) as err:
        case_from(data, tmp_path / "e.json", ReplayLimits(max_bytes=1000, max_flops=1e12))
    assert err.value.field == "case.geometry"
    assert " is inside the fuzz domain: " in str(err.value) and "GFLOP" not in str(err.value)


def test_a_huge_entry_is_refused_naming_the_field_furthest_outside_the_domain(tmp_path):
    """10^7 layers (3.3e6 x the domain's top) outweigh a vocab of 10^5 (98 x), though the
    vocab is the larger number times its top: the ratio decides."""
    data = _layout_entry()
    data["case"]["geometry"] |= {"n_layers": 10**7, "vocab": 10**5}
    path = _write(tmp_path / "e.json", data)
    message = (
        f"{path}: field 'case.geometry.n_layers' is 10000000: replaying this entry would need "
        "about 383 GiB (limit 2 GiB; raise it with --max-gib) and about 1.81e+04 GFLOP (limit "
        "50 GFLOP; raise it with --max-gflop), refused before allocating anything (estimate: "
        "4 B x (4 x 2.68e+09 parameters + 2e+06 activations) + 4 x 9e+07 tensors x 1024 B, "
        "1.81e+13 flops; see model.footprint)")
    for read in (lambda: load_entry(path), lambda: load_corpus([path]),
                 lambda: case_from(data, path)):
        with pytest.raises(CorpusEntryTooLarge) as err:
            read()
        assert str(err.value) == message
        assert (err.value.path, err.value.field) == (str(path), "case.geometry.n_layers")
        assert (err.value.estimate, err.value.flops) == (411553613632, 18072038400192)


def test_the_limits_given_reach_every_reader(tmp_path):
    path = _write(tmp_path / "e.json", _layout_entry())
    tight = ReplayLimits(max_bytes=COST.bytes - 1)
    for read in (lambda: load_entry(path, tight), lambda: load_corpus([path], tight)):
        with pytest.raises(CorpusEntryTooLarge):
            read()
    assert [type(e) for e in scan_corpus([path], tight).bad] == [CorpusEntryTooLarge]
    exact = ReplayLimits(max_bytes=COST.bytes)
    assert load_entry(path, exact).case.config == _config()
    assert [e.path for e in load_corpus([path], exact)] == [path]
    assert [e.path for e in scan_corpus([path], exact).entries] == [path]


def test_the_estimate_is_printed_in_gib_and_gflop(tmp_path, monkeypatch):
    """1.245e9 flops over a 1.235e9 flop limit print as 1.25 and 1.24 GFLOP: divided by
    exactly 1e9 (a hair more would round them down)."""
    monkeypatch.setattr(corpus, "footprint", lambda config: Footprint(
        params=10, activations=20, bytes=3 * GIB, flops=1_245_000_000, tensors=3))
    path = tmp_path / "e.json"
    with pytest.raises(CorpusEntryTooLarge) as err:
        case_from(_layout_entry(), path, ReplayLimits(max_bytes=GIB, max_flops=1.235e9))
    assert str(err.value) == (
        f"{path}: field 'case.geometry' is inside the fuzz domain: replaying this entry would "
        "need about 3 GiB (limit 1 GiB; raise it with --max-gib) and about 1.25 GFLOP (limit "
        "1.24 GFLOP; raise it with --max-gflop), refused before allocating anything (estimate: "
        "4 B x (4 x 10 parameters + 20 activations) + 4 x 3 tensors x 1024 B, 1.24e+09 flops; "
        "see model.footprint)")
    assert (err.value.estimate, err.value.flops) == (3 * GIB, 1_245_000_000)


def test_scan_corpus_reads_past_bad_files_keeping_their_typed_errors(tmp_path):
    good = _write(tmp_path / "a.json", _layout_entry())
    bad = _write(tmp_path / "b.json", _edit(_layout_entry(), "schema", 2))
    scan = scan_corpus([tmp_path], ReplayLimits())
    assert [e.path for e in scan.entries] == [good]
    (error,) = scan.bad
    assert type(error) is CorruptCorpusEntry and (error.path, error.field) == (str(bad), "schema")
    tight = scan_corpus([good], ReplayLimits(max_bytes=1000))
    assert tight.entries == [] and [type(e) for e in tight.bad] == [CorpusEntryTooLarge]
    assert entry_paths(tmp_path / "missing") == [] and entry_paths(good) == []


# --- make_entry, entry_name, write_entry --------------------------------------------------


class _Clock:
    """``datetime`` with a fixed ``now``: UTC is 03:04:05, any other zone answers otherwise."""

    @staticmethod
    def now(tz=None):
        moment = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
        return moment if tz is UTC else datetime(2026, 1, 2, 8, 34, 5)


@pytest.fixture
def fixed_env(monkeypatch):
    monkeypatch.setattr(corpus, "environment", lambda: {"commit": "c0ffee", "src_dirty": False})
    monkeypatch.setattr(corpus, "datetime", _Clock)


def test_make_entry_records_every_field(fixed_env):
    case = Case(_config("g"), src=1, dst=2, seed=5, mutation="kv_swapped", phase="1b")
    outcome = Outcome(case, deviation=0.5, threshold=0.25, shards_differ=True)
    entry = make_entry("invariant", outcome, worst_deviation=0.75, worst_ratio=3.0,
                       profile="wsb-test", hypothesis_seed=7, hypothesis_version="6.1")
    assert entry == {
        "schema": 1, "kind": "weight-sync-bench corpus entry", "property": "invariant",
        "origin": "seeded",
        "case": {"geometry": G, "degrees": {"src": 1, "dst": 2},
                 "seeds": {"param": 5, "token": 1005}, "mutation": "kv_swapped", "phase": "1b"},
        "measured": {"deviation": 0.5, "threshold": 0.25, "ratio": 2.0,
                     "worst_deviation_before_shrinking": 0.75,
                     "worst_ratio_before_shrinking": 3.0},
        "found": {"versions": versions("6.1"), "commit": "c0ffee", "src_dirty": False,
                  "profile": "wsb-test", "hypothesis_seed": 7, "date": "2026-01-02T03:04:05Z"},
    }
    assert entry["found"]["versions"]["hypothesis"] == "6.1"


def test_make_entry_of_a_conversion_records_its_conventions_and_non_finite_numbers(fixed_env):
    case = ConversionCase(_config("g"), "plain", 1, "meta", 2, seed=0)
    outcome = Outcome(case, deviation=float("nan"), threshold=0.5, shards_differ=False)
    entry = make_entry("convert", outcome, worst_deviation=float("inf"),
                       worst_ratio=float("-inf"), profile=None, hypothesis_seed=None,
                       hypothesis_version=None)
    assert entry["origin"] == "discovered"
    assert entry["case"] == {"geometry": G, "degrees": {"src": 1, "dst": 2},
                             "seeds": {"param": 0, "token": 1000}, "mutation": None,
                             "phase": "1a", "conventions": {"src": "plain", "dst": "meta"}}
    assert entry["measured"] == {"deviation": "nan", "threshold": 0.5, "ratio": "nan",
                                 "worst_deviation_before_shrinking": "inf",
                                 "worst_ratio_before_shrinking": "-inf"}


def test_make_entry_takes_a_given_origin_and_refuses_an_unknown_one(fixed_env):
    case = Case(_config("g"), 1, 2, 0, "kv_swapped")  # the rule would say seeded
    outcome = Outcome(case, 1.0, 0.5, True)
    kwargs = {"worst_deviation": 1.0, "worst_ratio": 2.0, "profile": None,
              "hypothesis_seed": None, "hypothesis_version": None}
    assert make_entry("invariant", outcome, **kwargs)["origin"] == "seeded"
    assert make_entry("invariant", outcome, origin="discovered", **kwargs)["origin"] == \
        "discovered"
    with pytest.raises(ValueError) as err:
        make_entry("invariant", outcome, origin="planted", **kwargs)
    assert str(err.value) == "origin must be one of seeded, discovered, got 'planted'"


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16] + ".json"


GEOMETRY_KEY = ('{"batch":1,"d_model":8,"ffn":4,"head_dim":2,"n_heads":2,"n_kv_heads":2,'
                '"n_layers":1,"seq_len":4,"vocab":16}')


def test_entry_name_hashes_the_canonical_json_of_property_case_and_user():
    case = Case(_config("g"), src=1, dst=2, seed=0)
    key = ('{"degrees":{"dst":2,"src":1},"geometry":' + GEOMETRY_KEY
           + ',"mutation":null,"phase":"1a","property":"kill","seed":0')
    name = entry_name("kill", case)
    assert re.fullmatch(r"[0-9a-f]{16}\.json", name)
    assert name == _sha(key + "}") == entry_name("kill", case, None) == entry_name("kill", case, {})
    user = {"role": "resharder", "function": "mod:fn", "source_file": "/x.py"}
    assert entry_name("kill", case, user) == _sha(
        key + ',"user":{"function":"mod:fn","role":"resharder"}}')
    assert entry_name("kill", case, {"function": "mod:fn"}) == _sha(
        key + ',"user":{"function":"mod:fn","role":null}}')
    conversion = ConversionCase(_config("g"), "plain", 1, "meta", 2, seed=0)
    assert entry_name("convert", conversion) == _sha(
        '{"conventions":{"dst":"meta","src":"plain"},"degrees":{"dst":2,"src":1},"geometry":'
        + GEOMETRY_KEY + ',"mutation":null,"phase":"1a","property":"convert","seed":0}')


def test_every_committed_entry_is_named_by_its_hash():
    paths = entry_paths()
    assert paths
    for path in paths:
        entry = load_entry(path)
        assert entry_name(entry.prop, entry.case, entry.user) == path.name


def test_write_entry_writes_indented_json_under_its_name_creating_the_directory(tmp_path,
                                                                               monkeypatch):
    links = []
    real_link = os.link

    def link(src, dst):
        links.append((Path(src), Path(dst), Path(src).read_text()))
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", link)
    directory = tmp_path / "a" / "b"
    entry = _layout_entry()
    path, created = write_entry(entry, directory)
    case = Case(_config("corpus:<new>"), 1, 2, 0, "lm_head_reversed")
    assert created and path == directory / entry_name("invariant", case)
    assert path.read_text() == json.dumps(entry, indent=2) + "\n"
    ((tmp, linked, text),) = links
    assert linked == path and text == path.read_text() and tmp.parent == directory
    assert re.fullmatch(rf"\.{re.escape(path.name)}\.{os.getpid()}\.[0-9a-f]{{8}}\.tmp",
                        tmp.name)
    assert sorted(directory.iterdir()) == [path]  # the temporary file is gone
    user = {"role": "resharder", "function": "mod:fn"}
    mine, created = write_entry(entry | {"user": user}, directory)
    assert created and mine == directory / entry_name("invariant", case, user) != path
    again, created = write_entry(entry | {"origin": "discovered"}, directory)
    assert (again, created) == (path, False)
    assert json.loads(path.read_text())["origin"] == "seeded"  # never overwritten


def test_write_entry_refuses_a_bad_entry_naming_the_new_file(tmp_path):
    with pytest.raises(CorruptCorpusEntry) as err:
        write_entry(_edit(_layout_entry(), "case.phase", "2"), tmp_path)
    new = tmp_path / "<new>"
    assert str(err.value) == f"{new}: field 'case.phase' is '2', expected one of 1a, 1b"
    assert (err.value.path, err.value.field) == (str(new), "case.phase")
    assert list(tmp_path.iterdir()) == []


# --- replay ---------------------------------------------------------------------------------


def _entry(data: dict, name: str = "e.json", directory: Path = Path("/corpus")) -> Entry:
    return Entry(directory / name, data, case_from(data, directory / name))


def test_replay_of_a_user_entry_needs_load_and_hands_it_everything(monkeypatch):
    from weight_sync_bench.fuzz import replay as replay_module

    user = {"role": "resharder", "function": "mod:fn"}
    first = _entry(_layout_entry() | {"user": user}, "a.json")
    second = _entry(_layout_entry() | {"user": user}, "b.json")
    with pytest.raises(InvalidConfig) as err:
        list(replay([first]))
    assert str(err.value) == ("/corpus/a.json: a user function's entry (mod:fn): replay needs "
                              "load=")
    calls = []
    monkeypatch.setattr(replay_module, "replay_entry", lambda entry, **kw: calls.append(
        (entry, kw)) or f"replayed {entry.path.name}")

    def load(function, role):
        raise AssertionError("the stand-in replay_entry never loads")

    def rule(config, ref):
        return 1.0

    out = list(replay([first, second], forward="FORWARD", threshold_rule=rule, load=load))
    assert out == ["replayed a.json", "replayed b.json"]
    assert calls == [(e, {"load": load, "forward": "FORWARD", "threshold_rule": rule})
                     for e in (first, second)]


def test_replay_runs_the_case_with_the_given_forward_and_threshold_rule():
    entry = _entry(_layout_entry())
    calls = []

    def forward(config, shards, tokens):
        calls.append(len(shards))
        return inprocess_forward(config, shards, tokens)

    (result,) = replay([entry], forward=forward, threshold_rule=lambda config, ref: 1e6)
    assert result.outcome.threshold == 1e6 and result.status == "fixed"
    assert result.entry is entry and calls  # the sharded forward went through ``forward``
    (strict,) = replay([entry], threshold_rule=lambda config, ref: 1e-9)
    assert strict.outcome.threshold == 1e-9 and strict.status != "fixed"


# --- format_replay --------------------------------------------------------------------------


def _replayed(data: dict, name: str, deviation: float, threshold: float, status: str,
              note: str | None = None) -> Replayed:
    entry = _entry(data, name)
    return Replayed(entry, Outcome(entry.case, deviation, threshold, shards_differ=True), status,
                    note)


def _results() -> list[Replayed]:
    conversion = _conversion_entry() | {"user": {"role": "converter", "function": "pkg:conv"}}
    layout = _edit(_layout_entry(), "case.mutation", None) | {
        "origin": "discovered", "user": {"role": "resharder", "function": "mod:fn"}}
    legacy = _edit(_edit(_layout_entry(), "case.mutation", "kv_swapped"), "origin", DROP)
    seeded = _layout_entry()  # lm_head_reversed at 1 -> 2: not the identity there
    return [_replayed(legacy, "legacy.json", 0.25, 0.001, "still failing"),
            _replayed(conversion, "conv.json", 0.5, 0.001, "drifted"),
            _replayed(layout, "mine.json", 1e-5, 0.001, "fixed", note="source changed"),
            _replayed(seeded, "s.json", 0.004, 0.001, "environment changed")]


LEGACY_NOTE = ("note, legacy.json: no 'origin' field (written before origins were recorded): "
               "counted as seeded, inferred from property 'invariant' and mutation 'kv_swapped'")


def test_format_replay_prints_discovered_then_seeded_tables_with_notes():
    lines = [
        "discovered (2 entries, the claim holds on 1):",
        "entry      property   mutation  src -> dst         deviation  ratio  status   claim",
        "conv.json  convert    -         plain:1 -> meta:2  0.5        500x   drifted  BROKEN",
        "mine.json  invariant  -         1 -> 2             1e-05      0.01x  fixed    holds",
        "note, conv.json: the converter pkg:conv",
        "note, mine.json: the resharder mod:fn; source changed",
        "",
        "seeded (2 entries, the claim holds on 1):",
        ("entry        property   mutation          src -> dst  deviation  ratio  status"
         "               claim"),
        ("legacy.json  invariant  kv_swapped        1 -> 2      0.25       250x   still failing"
         "        holds"),
        ("s.json       invariant  lm_head_reversed  1 -> 2      0.004      4x     environment "
         "changed  BROKEN"),
        LEGACY_NOTE,
    ]
    assert format_replay(_results()) == "\n".join(lines)


def test_format_replay_of_one_origin_prints_one_table_and_keeps_a_note_verbatim():
    legacy, _, mine, _ = _results()
    lines = [
        "seeded (1 entry, the claim holds on 1):",
        "entry        property   mutation    src -> dst  deviation  ratio  status         claim",
        "legacy.json  invariant  kv_swapped  1 -> 2      0.25       250x   still failing  holds",
        LEGACY_NOTE,
    ]
    assert format_replay([legacy]) == "\n".join(lines)
    trailing = Replayed(mine.entry, mine.outcome, mine.status, note="source changed ")
    assert format_replay([trailing]).endswith("\nnote, mine.json: the resharder mod:fn; source "
                                              "changed ")
    index = _replayed(_layout_entry() | {"user": {"role": "resharder",
                                                  "function": "mod:SHARD_INDEX"}},
                      "i.json", 0.25, 0.001, "still failing")
    assert format_replay([index]).endswith("\nnote, i.json: the resharder mod:SHARD_INDEX")
    assert format_replay([]) == ""


def test_a_deep_thin_entry_is_refused_before_its_layout_is_built(tmp_path, monkeypatch):
    """Six million one-wide layers: the element counts alone call it a few GiB and GFLOP,
    the per-tensor bookkeeping and per-kernel dispatch (``model.footprint.TENSOR_BYTES``,
    ``KERNEL_FLOPS``) make it what it is. Building its layout first would take minutes."""
    def never(*args, **kwargs):
        raise AssertionError("the layout was built before the footprint check")
    monkeypatch.setattr(corpus, "layout_for", never)
    data = _layout_entry()
    data["case"]["geometry"] |= {"n_layers": 6_000_000}
    with pytest.raises(CorpusEntryTooLarge) as err:
        case_from(data, tmp_path / "e.json")
    assert err.value.field == "case.geometry.n_layers"
    # twin: the same entry at the domain's depth loads
    monkeypatch.undo()
    assert case_from(_layout_entry(), tmp_path / "e.json").config == _config()


def test_a_convention_name_that_is_not_a_string_is_a_corrupt_entry_not_a_crash(tmp_path):
    good = _write(tmp_path / "good.json", _layout_entry())
    data = _conversion_entry()
    data["case"]["conventions"]["src"] = ["plain"]
    bad = _write(tmp_path / "bad.json", data)
    scan = scan_corpus([good, bad])
    assert [e.path for e in scan.entries] == [good]
    (error,) = scan.bad
    assert isinstance(error, CorruptCorpusEntry) and error.field == "case.conventions.src"
    assert "is ['plain'], expected one of plain, megatron, vllm, hf, meta" in str(error)
