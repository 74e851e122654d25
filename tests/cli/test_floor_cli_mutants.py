"""``wsb floor``'s parser (the mutation pass over ``cli/floor.py``'s ``register`` and the
option builders ``_where``, ``_measure_options``, ``_random_options``,
``_replicated_options``, ``_moe_options``): every kind's options by flag, destination,
default, type, choices, metavar and help; the argument groups; ``--out`` and ``--write``
exclusive; the kinds' help and descriptions; and what a command line parses to.

``cmd_floor`` and ``as_floor_argv`` are ``tests/cli/test_floor_dispatch_mutants.py``'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from weight_sync_bench.check import floor as phase_floor
from weight_sync_bench.cli import floor as F
from weight_sync_bench.cli.output import count, positive, seed
from weight_sync_bench.fuzz.floor import (
    MOE_GEOMETRIES,
    MOE_SEED,
    REPLICATED_GEOMETRIES,
    REPLICATED_SEED,
)
from weight_sync_bench.training import floor as training_floor


def wsb() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsb")
    F.register(parser.add_subparsers(dest="command", required=True))
    return parser


def floor_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["floor"]


def kinds_action(floor: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (sub,) = [a for a in floor._actions if isinstance(a, argparse._SubParsersAction)]
    return sub


def kind_parser(kind: str) -> argparse.ArgumentParser:
    return kinds_action(floor_parser(wsb())).choices[kind]


def options(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """dest -> (flags, default, type, choices, metavar, help), for every optional."""
    return {a.dest: (tuple(a.option_strings), a.default, a.type,
                     None if a.choices is None else list(a.choices), a.metavar, a.help)
            for a in parser._actions if a.option_strings}


# -- the help texts, as the user reads them

OUT = "write the artifact here (a merge with what is there, as --write)"
WRITE = ("replace the committed artifact under tolerance/ (geometry: into the checkout's "
         "tolerance/geometry/; without it a geometry's floor goes to your floor cache, "
         "WSB_FLOOR_CACHE, else $XDG_CACHE_HOME/weight-sync-bench)")
KERNEL_SETS = ("all (default): measure once per CPU kernel set torch can use here "
               "(ATEN_CPU_CAPABILITY), each in a process of its own, and keep the worst "
               "(tolerance.kernels); current: only the kernels this process runs")
QUIET = "no progress line; print failures and the closing line only"
MEASURE_FORCE = ("replace even a measurement of more repetitions than this one, or one that "
                 "holds other CPU vendors' figures beside this one's; a geometry already "
                 "measured here is measured again")
RANDOM_FORCE = "replace even a measurement of more geometries than this one"
VALIDATION_FORCE = "replace a validation that holds other CPU vendors' figures"
REPETITIONS = (f"default: {phase_floor.REPETITIONS} (phase), "
               f"{phase_floor.GEOMETRY_REPETITIONS} (geometry), "
               f"{training_floor.REPETITIONS} (training, sequence)")
DTYPE = ("the synced weights' dtype (phase, geometry): bf16 and fp16 weights are compared "
         "bit-exactly and computed in fp32; fp8_block128 / fp8_tensor (phase 1a): an FP8 "
         "destination's, bf16 weights quantized by the reference quantizer, computed "
         "dequantized")
LIMITED = "refuse a geometry (geometry; phase 1a streamed per layer) whose estimated "
SAMPLES_FROM = ("re-measure the samples of PATH (default: the committed artifact) instead of "
                "drawing new ones")
SEARCH = ("also search M examples (Hypothesis target phase) for the largest floor / "
          "max|logit|, and sample the worst --keep of them")
VALIDATION_FROM = ("re-measure the samples of the validation at PATH instead of drawing new "
                   "ones")


def where(force: str) -> dict[str, tuple]:
    return {
        "out": (("--out",), None, Path, None, None, OUT),
        "write": (("--write",), False, None, None, None, WRITE),
        "force": (("--force",), False, None, None, None, force),
        "kernel_sets": (("--kernel-sets",), "all", None, ["all", "current"], None, KERNEL_SETS),
        "quiet": (("-q", "--quiet"), False, None, None, None, QUIET)}


HELP = {"help": (("-h", "--help"), argparse.SUPPRESS, None, None, None,
                 "show this help message and exit")}

MEASURE = {
    **HELP,
    "phase": (("--phase",), "1a", None, ["1a", "1b"], None, None),
    "repetitions": (("--repetitions",), None, count, None, None, REPETITIONS),
    "steps": (("--steps",), training_floor.STEPS, count, None, None,
              "optimizer steps (training, sequence)"),
    "dtype": (("--dtype",), "fp32", None, ["fp32", "bf16", "fp16", "fp8_block128", "fp8_tensor"],
              None, DTYPE),
    "hf_config": (("--hf-config",), None, Path, None, "PATH",
                  "a Hugging Face config.json (geometry)"),
    "config": (("--config",), None, None, ["toy", "toy_kv4", "toy_moe", "toy_moe_ds"], None,
               "a built-in config (geometry)"),
    "layers": (("--layers",), None, count, None, None,
               "override the HF config's num_hidden_layers (geometry)"),
    "vocab": (("--vocab",), None, count, None, None,
              "override the HF config's vocab_size (geometry)"),
    "batch": (("--batch",), None, count, None, None, "token batch (geometry)"),
    "seq_len": (("--seq-len",), None, count, None, None, "token length (geometry)"),
    **where(MEASURE_FORCE)}

RANDOM = {
    **HELP,
    "random": (("--random",), None, count, None, "N", "number of geometries to sample (>= 2)"),
    "source": (("--from",), None, Path, None, "PATH", SAMPLES_FROM),
    "search": (("--search",), None, count, None, "M", SEARCH),
    "keep": (("--keep",), 20, count, None, "K", None),
    "phase": (("--phase",), "1a", None, ["1a", "1b"], None, None),
    "seed": (("--seed",), None, seed, None, None, "Hypothesis seed (default: random)"),
    **where(RANDOM_FORCE)}

REPLICATED = {
    **HELP,
    "phase": (("--phase",), "1a", None, ["1a"], None, None),
    "geometries": (("--geometries",), REPLICATED_GEOMETRIES, count, None, None, None),
    "seed": (("--seed",), REPLICATED_SEED, seed, None, None, "the draw's seed"),
    "source": (("--from",), None, Path, None, "PATH", VALIDATION_FROM),
    **where(VALIDATION_FORCE)}

MOE = {
    **HELP,
    "phase": (("--phase",), "1a", None, ["1a"], None, None),
    "geometries": (("--geometries",), MOE_GEOMETRIES, count, None, None,
                   f"MoE geometries to draw (default {MOE_GEOMETRIES})"),
    "seed": (("--seed",), MOE_SEED, seed, None, None,
             f"the draw's Hypothesis seed (default {MOE_SEED})"),
    "source": (("--from",), None, Path, None, "PATH", VALIDATION_FROM),
    **where(VALIDATION_FORCE)}

DEADLINE_FLAGS = (("--deadline",), None, positive, None, "SECONDS")


def test_the_measured_defaults_the_help_quotes():
    # the help above quotes these module constants; pin them so a drift reads plainly
    assert (phase_floor.REPETITIONS, phase_floor.GEOMETRY_REPETITIONS) == (20, 4)
    assert (training_floor.REPETITIONS, training_floor.STEPS) == (2, 3)
    assert REPETITIONS == "default: 20 (phase), 4 (geometry), 2 (training, sequence)"


@pytest.mark.parametrize("kind", ["phase", "geometry", "training", "sequence"])
def test_each_measuring_kind_has_the_measuring_options(kind):
    got = options(kind_parser(kind))
    limits = {d: got.pop(d) for d in ("max_gib", "max_gflop")}
    assert got == MEASURE
    assert list(got) == list(MEASURE)  # and in this order, as --help lists them
    for dest, flag, what in (("max_gib", "--max-gib", "memory exceeds G GiB"),
                             ("max_gflop", "--max-gflop", "work exceeds F GFLOP")):
        flags, _, type_, _, _, text = limits[dest]
        assert (flags, type_) == ((flag,), positive)
        assert text.startswith(LIMITED + what), text


def test_the_random_kind_and_bare_floor_have_the_random_options():
    for parser in (kind_parser("random"), floor_parser(wsb())):
        got = options(parser)
        assert got.pop("deadline")[:5] == DEADLINE_FLAGS
        assert got == RANDOM
        assert list(got) == list(RANDOM)


def test_the_replicated_kv_kind_has_its_options():
    got = options(kind_parser("replicated-kv"))
    assert got == REPLICATED
    assert list(got) == list(REPLICATED)


def test_the_moe_kind_has_its_options():
    got = options(kind_parser("moe"))
    assert got == MOE
    assert list(got) == list(MOE)


def test_the_draws_defaults():
    assert (REPLICATED_GEOMETRIES, REPLICATED_SEED) == (300, 20261201)
    assert (MOE_GEOMETRIES, MOE_SEED) == (300, 20261201)


# -- the groups


def groups(parser: argparse.ArgumentParser) -> list[tuple]:
    return [(g.title, g.description, [a.dest for a in g._group_actions])
            for g in parser._action_groups]


@pytest.mark.parametrize("kind", ["phase", "geometry", "training", "sequence"])
def test_the_geometry_options_are_a_group_of_their_own(kind):
    assert groups(kind_parser(kind))[2] == (
        "geometry", "the geometry whose floor is measured",
        ["hf_config", "config", "layers", "vocab", "batch", "seq_len", "max_gib", "max_gflop"])
    assert len(groups(kind_parser(kind))) == 3


@pytest.mark.parametrize("kind", [*F.KINDS, None])
def test_out_and_write_are_exclusive(kind, tmp_path, capsys):
    parser = wsb()
    argv = ["floor"] + ([kind] if kind else [])
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*argv, "--out", str(tmp_path / "a.json"), "--write"])
    assert exit_.value.code == 2
    assert "argument --write: not allowed with argument --out" in capsys.readouterr().err
    # the twin: either alone parses
    assert parser.parse_args([*argv, "--write"]).write is True
    assert parser.parse_args([*argv, "--out", "a.json"]).out == Path("a.json")
    (group,) = floor_parser(parser)._mutually_exclusive_groups
    assert [a.dest for a in group._group_actions] == ["out", "write"]


# -- the command and its kinds


def test_floor_is_a_command_with_its_help_description_and_epilog():
    parser = wsb()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert [(a.dest, a.help) for a in sub._choices_actions] == [
        ("floor", "measure a numerical floor")]
    floor = sub.choices["floor"]
    assert floor.description == (
        "Measure a numerical floor and write its artifact: under every CPU kernel set, merged, "
        "beside other CPU vendors' figures (--out PATH, or --write to replace the committed "
        "one).")
    assert floor.epilog == (
        "Without a KIND: the random-geometry floor (wsb floor random). python -m "
        "weight_sync_bench.tolerance [KIND] is wsb floor, phase by default.")


KIND_HELP = [
    ("phase", "the logits floor of TOY and TOY_KV4 (tolerance/phase<P>[_<dtype>].json)"),
    ("random", "floor samples on random geometries and the fuzz's rule "
               "(tolerance/random_floor_<P>.json)"),
    ("geometry", "one geometry's floor (tolerance/geometry/)"),
    ("replicated-kv", "the random-geometry rule validated on vLLM's replicated-KV forward"),
    ("moe", "the random-geometry rule validated on the Mixture-of-Experts forwards "
            "(tolerance/random_floor_<P>_moe.json)"),
    ("training", "the training floors (training[_1b].json)"),
    ("sequence", "the SP / CP training floors (sequence[_1b].json)")]


def test_each_kind_has_its_help_and_description():
    kinds = kinds_action(floor_parser(wsb()))
    assert (kinds.dest, kinds.metavar) == ("kind", "KIND")
    assert [(a.dest, a.help) for a in kinds._choices_actions] == KIND_HELP
    assert list(kinds.choices) == list(F.KINDS) == [k for k, _ in KIND_HELP]
    for kind, text in KIND_HELP:
        assert kinds.choices[kind].description == text


def test_floor_help_lists_the_kinds_under_kind(capsys):
    with pytest.raises(SystemExit):
        wsb().parse_args(["floor", "--help"])
    out = capsys.readouterr().out
    assert "{phase,random" not in out and "[-q] [--deadline SECONDS] KIND ..." in " ".join(
        out.split())


# -- what command lines parse to


def parsed(argv: list[str]) -> dict:
    got = vars(wsb().parse_args(argv))
    assert got.pop("command") == "floor"
    assert got.pop("func") is F.cmd_floor
    return got


RANDOM_DEFAULTS = {"random": None, "source": None, "search": None, "keep": 20, "phase": "1a",
                   "seed": None, "out": None, "write": False, "force": False,
                   "kernel_sets": "all", "quiet": False, "deadline": None}
MEASURE_DEFAULTS = {"phase": "1a", "repetitions": None, "steps": 3, "dtype": "fp32",
                    "hf_config": None, "config": None, "layers": None, "vocab": None,
                    "batch": None, "seq_len": None, "max_gflop": 10000.0, "out": None,
                    "write": False, "force": False, "kernel_sets": "all", "quiet": False}


# the bare command's own options (``wsb floor --random N``) stay in a kind's namespace
BARE = {"random": None, "source": None, "search": None, "keep": 20, "seed": None,
        "deadline": None}


def test_bare_floor_parses_to_the_random_defaults_and_no_kind():
    got = parsed(["floor"])
    assert got == {**RANDOM_DEFAULTS, "kind": None}
    assert parsed(["floor", "random"]) == {**RANDOM_DEFAULTS, "kind": "random"}


@pytest.mark.parametrize("kind", ["phase", "geometry", "training", "sequence"])
def test_a_measuring_kind_parses_to_its_defaults(kind):
    got = parsed(["floor", kind])
    got.pop("max_gib")  # this machine's memory or None: cli.output's
    assert got == {**BARE, **MEASURE_DEFAULTS, "kind": kind}


@pytest.mark.parametrize("kind, geometries, seed_", [
    ("replicated-kv", REPLICATED_GEOMETRIES, REPLICATED_SEED), ("moe", MOE_GEOMETRIES, MOE_SEED)])
def test_a_validating_kind_parses_to_its_defaults(kind, geometries, seed_):
    assert parsed(["floor", kind]) == {
        **BARE, "phase": "1a", "geometries": geometries, "seed": seed_, "source": None, "out": None,
        "write": False, "force": False, "kernel_sets": "all", "quiet": False, "kind": kind}


def test_every_option_of_the_random_kind_is_read(tmp_path):
    got = parsed(["floor", "--random", "5", "--from", str(tmp_path), "--search", "7",
                  "--keep", "3", "--phase", "1b", "--seed", "9", "--out", "o.json", "--force",
                  "--kernel-sets", "current", "-q", "--deadline", "2.5"])
    assert got == {"random": 5, "source": tmp_path, "search": 7, "keep": 3, "phase": "1b",
                   "seed": 9, "out": Path("o.json"), "write": False, "force": True,
                   "kernel_sets": "current", "quiet": True, "deadline": 2.5, "kind": None}


def test_every_option_of_a_measuring_kind_is_read(tmp_path):
    config = tmp_path / "config.json"
    got = parsed(["floor", "geometry", "--phase", "1b", "--repetitions", "4", "--steps", "2",
                  "--dtype", "bf16", "--hf-config", str(config), "--layers", "2",
                  "--vocab", "64", "--batch", "3", "--seq-len", "8", "--max-gib", "1.5",
                  "--max-gflop", "20", "--write", "--force", "--kernel-sets", "current",
                  "--quiet"])
    assert got == {**BARE, "phase": "1b", "repetitions": 4, "steps": 2, "dtype": "bf16",
                   "hf_config": config, "config": None, "layers": 2, "vocab": 64,
                   "batch": 3, "seq_len": 8, "max_gib": 1.5, "max_gflop": 20.0, "out": None,
                   "write": True, "force": True, "kernel_sets": "current", "quiet": True,
                   "kind": "geometry"}
    assert parsed(["floor", "phase", "--config", "toy_kv4"])["config"] == "toy_kv4"
    assert parsed(["floor", "phase", "--dtype", "fp8_tensor"])["dtype"] == "fp8_tensor"


@pytest.mark.parametrize("kind", ["replicated-kv", "moe"])
def test_every_option_of_a_validating_kind_is_read(kind, tmp_path):
    got = parsed(["floor", kind, "--phase", "1a", "--geometries", "6", "--seed", "11",
                  "--from", str(tmp_path), "--out", "v.json", "--force",
                  "--kernel-sets", "current", "-q"])
    assert got == {**BARE, "phase": "1a", "geometries": 6, "seed": 11, "source": tmp_path,
                   "out": Path("v.json"), "write": False, "force": True,
                   "kernel_sets": "current", "quiet": True, "kind": kind}


@pytest.mark.parametrize("argv, message", [
    (["floor", "--random", "0"], "argument --random: must be > 0, got 0"),
    (["floor", "--keep", "0"], "argument --keep: must be > 0, got 0"),
    (["floor", "--search", "0"], "argument --search: must be > 0, got 0"),
    (["floor", "--seed", "-1"], "argument --seed: must be an int in 0..2^63-1, got -1"),
    (["floor", "--phase", "2"], "argument --phase: invalid choice: '2'"),
    (["floor", "--kernel-sets", "some"], "argument --kernel-sets: invalid choice: 'some'"),
    (["floor", "--deadline", "0"], "argument --deadline: must be > 0 and finite, got 0"),
    (["floor", "phase", "--repetitions", "0"], "argument --repetitions: must be > 0, got 0"),
    (["floor", "phase", "--steps", "0"], "argument --steps: must be > 0, got 0"),
    (["floor", "phase", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["floor", "phase", "--config", "big"], "argument --config: invalid choice: 'big'"),
    (["floor", "geometry", "--layers", "0"], "argument --layers: must be > 0, got 0"),
    (["floor", "geometry", "--vocab", "0"], "argument --vocab: must be > 0, got 0"),
    (["floor", "geometry", "--batch", "0"], "argument --batch: must be > 0, got 0"),
    (["floor", "geometry", "--seq-len", "0"], "argument --seq-len: must be > 0, got 0"),
    (["floor", "geometry", "--max-gib", "0"], "argument --max-gib: must be > 0 and finite"),
    (["floor", "training", "--phase", "1c"], "argument --phase: invalid choice: '1c'"),
    (["floor", "moe", "--phase", "1b"], "argument --phase: invalid choice: '1b'"),
    (["floor", "moe", "--geometries", "0"], "argument --geometries: must be > 0, got 0"),
    (["floor", "moe", "--seed", "-1"], "argument --seed: must be an int in 0..2^63-1, got -1"),
    (["floor", "replicated-kv", "--phase", "1b"], "argument --phase: invalid choice: '1b'"),
    (["floor", "replicated-kv", "--geometries", "0"],
     "argument --geometries: must be > 0, got 0"),
    (["floor", "replicated-kv", "--seed", "-1"],
     "argument --seed: must be an int in 0..2^63-1, got -1"),
    (["floor", "replicated-kv", "--seed", str(2 ** 63)],
     f"argument --seed: must be an int in 0..2^63-1, got {2 ** 63}"),
    (["floor", "sequence", "--write", "--out", "x"],
     "argument --out: not allowed with argument --write"),
])
def test_a_bad_value_is_refused_by_its_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        wsb().parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kind, flag", [
    ("phase", "--random"), ("moe", "--random"), ("random", "--geometries"),
    ("replicated-kv", "--dtype"), ("moe", "--deadline"), ("geometry", "--deadline"),
    ("random", "--hf-config"), ("replicated-kv", "--json")])
def test_a_kind_refuses_the_options_it_does_not_have(kind, flag, capsys):
    with pytest.raises(SystemExit):
        wsb().parse_args(["floor", kind, flag, "1"])
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_an_option_before_the_kind_is_refused_not_dropped(capsys):
    """argparse parses bare ``wsb floor``'s options first and lets the kind's own default
    of the same option replace them: ``--out`` went unread, the artifact to the cache."""
    for argv, given, kind in ((["--out", "x.json", "--force", "phase"], "--out, --force", "phase"),
                              (["--phase", "1b", "moe"], "--phase", "moe"),
                              (["-q", "training"], "--quiet", "training")):  # its long name
        with pytest.raises(SystemExit) as refused:
            wsb().parse_args(["floor", *argv])
        assert refused.value.code == 2
        assert (f"{given} given before the KIND {kind}: a kind's options go after it "
                f"(wsb floor {kind} --help lists them)") in capsys.readouterr().err
    after = wsb().parse_args(["floor", "phase", "--out", "x.json", "--force"])  # the twins
    assert (after.kind, after.out, after.force) == ("phase", Path("x.json"), True)
    bare = wsb().parse_args(["floor", "--random", "5", "--phase", "1b"])
    assert (bare.kind, bare.random, bare.phase) == (None, 5, "1b")
    at_default = wsb().parse_args(["floor", "--phase", "1a", "moe", "--phase", "1a"])
    assert (at_default.kind, at_default.phase) == ("moe", "1a")
