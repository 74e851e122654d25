"""The typed errors (the mutation pass over ``errors.py``): each error's message is its
``str``, each keyword it takes is the attribute it sets (and the mapping ones default to an
empty dict of their own), the subclasses hand their message and keywords on to their bases,
and ``InvalidNumber``'s three checks accept and refuse at their boundaries, by message.
"""

from __future__ import annotations

import math

import pytest

from weight_sync_bench.errors import (
    CheckpointError,
    CorpusEntryTooLarge,
    CorpusNotWritable,
    CorruptCorpusEntry,
    FloorNotMeasured,
    GeometryTooLarge,
    InvalidCover,
    InvalidNumber,
    LauncherCrash,
    MismatchedOptions,
    ModifiedInput,
    RankCrash,
    RankFailure,
    RankStopped,
    RankTimeout,
    Uncovered,
    UnknownMutation,
    UnsafeFile,
    UserCodeError,
    WrongShardShape,
    WrongUserShard,
)

# -- the message is the error's str and its only arg


@pytest.mark.parametrize("make", [
    lambda m: Uncovered(m), lambda m: FloorNotMeasured(m), lambda m: WrongShardShape(m),
    lambda m: RankFailure(m), lambda m: RankCrash(m), lambda m: RankTimeout(m),
    lambda m: RankStopped(m), lambda m: MismatchedOptions(m), lambda m: CorruptCorpusEntry(m),
    lambda m: CorpusNotWritable(m), lambda m: UserCodeError(m), lambda m: ModifiedInput(m),
    lambda m: WrongUserShard(m), lambda m: GeometryTooLarge(m), lambda m: CorpusEntryTooLarge(m),
    lambda m: InvalidCover(m), lambda m: CheckpointError(m), lambda m: UnsafeFile(m),
    lambda m: LauncherCrash(m, launcher="forkserver", launcher_pid=7, launcher_end="gone"),
    lambda m: UnknownMutation(m)])
def test_every_error_keeps_its_message_as_its_str(make):
    err = make("the message")
    assert str(err) == "the message"
    assert err.args == ("the message",)


def test_a_plain_exception_with_no_message_has_an_empty_str():
    # the twin of the above: an error built without the message would read "" (or "None")
    assert str(Exception()) == "" and str(Exception(None)) == "None"


# -- keywords become attributes


def test_uncovered_keeps_its_missing_map_and_defaults_to_an_empty_one():
    missing = {1: ["a", "b"]}
    assert Uncovered("m", missing=missing).missing is missing
    assert Uncovered("m").missing == {}
    assert Uncovered("m", missing={}).missing == {}
    assert Uncovered("m").missing is not Uncovered("m").missing


def test_floor_not_measured_keeps_its_command_and_why():
    err = FloorNotMeasured("no floor; run wsb floor", command="wsb floor", why="no floor")
    assert (err.command, err.why) == ("wsb floor", "no floor")
    bare = FloorNotMeasured("no floor")
    assert (bare.command, bare.why) == (None, "no floor")
    assert FloorNotMeasured("m", why="").why == ""


def test_wrong_shard_shape_keeps_every_field():
    err = WrongShardShape("m", rank=3, name="w", expected=(2, 4), actual=(2, 5),
                          expected_dtype="fp32", actual_dtype="bf16")
    assert (err.rank, err.name, err.expected, err.actual) == (3, "w", (2, 4), (2, 5))
    assert (err.expected_dtype, err.actual_dtype) == ("fp32", "bf16")
    bare = WrongShardShape("m")
    assert (bare.rank, bare.name, bare.expected, bare.actual) == (None,) * 4
    assert (bare.expected_dtype, bare.actual_dtype) == (None, None)


def test_wrong_user_shard_keeps_every_field_and_the_user_code_ones():
    err = WrongUserShard("m", rank=1, name="w", expected=(4,), actual=(5,),
                         expected_dtype="fp32", actual_dtype="fp16", role="resharder",
                         function="mod:fn", user_traceback="tb")
    assert (err.rank, err.name, err.expected, err.actual) == (1, "w", (4,), (5,))
    assert (err.expected_dtype, err.actual_dtype) == ("fp32", "fp16")
    assert (err.role, err.function, err.user_traceback) == ("resharder", "mod:fn", "tb")
    bare = WrongUserShard("m")
    assert (bare.rank, bare.name, bare.expected, bare.actual) == (None,) * 4
    assert (bare.expected_dtype, bare.actual_dtype, bare.role) == (None, None, None)


def test_rank_failure_keeps_every_field():
    err = RankFailure("m", rank=2, remote_traceback="tb", raised_at=1.5, pids=(10, 11),
                      breadcrumb="op 3")
    assert (err.rank, err.remote_traceback, err.raised_at) == (2, "tb", 1.5)
    assert (err.pids, err.breadcrumb) == ((10, 11), "op 3")
    bare = RankFailure("m")
    assert (bare.rank, bare.remote_traceback, bare.raised_at) == (None, None, None)
    assert (bare.pids, bare.breadcrumb) == ((), None)


def test_rank_crash_keeps_its_fields_and_hands_the_rest_to_rank_failure():
    err = RankCrash("m", signal_name="SIGKILL", exit_code=-9, rank=1, pids=(5,),
                    breadcrumb="b", remote_traceback="tb", raised_at=2.0)
    assert (err.signal_name, err.exit_code) == ("SIGKILL", -9)
    assert (err.rank, err.pids, err.breadcrumb) == (1, (5,), "b")
    assert (err.remote_traceback, err.raised_at) == ("tb", 2.0)
    bare = RankCrash("m")
    assert (bare.signal_name, bare.exit_code, bare.rank) == (None, None, None)


def test_launcher_crash_keeps_its_fields_and_hands_the_rest_on():
    err = LauncherCrash("m", launcher="forkserver", launcher_pid=42,
                        launcher_end="killed by SIGKILL", rank=0, exit_code=255,
                        signal_name="SIGTERM", pids=(1, 2))
    assert (err.launcher, err.launcher_pid, err.launcher_end) == (
        "forkserver", 42, "killed by SIGKILL")
    assert (err.rank, err.exit_code, err.signal_name, err.pids) == (0, 255, "SIGTERM", (1, 2))
    assert isinstance(err, RankCrash) and isinstance(err, RankFailure)


def test_rank_timeout_keeps_stuck_and_stacks_and_hands_the_rest_on():
    stacks = {0: "stack 0"}
    err = RankTimeout("m", stuck=(1,), stacks=stacks, rank=1, pids=(3, 4))
    assert (err.stuck, err.stacks, err.rank, err.pids) == ((1,), stacks, 1, (3, 4))
    assert err.stacks is stacks
    bare = RankTimeout("m")
    assert (bare.stuck, bare.stacks, bare.rank) == ((), {}, None)
    assert RankTimeout("m", stacks={}).stacks == {}


def test_rank_stopped_keeps_states_and_hands_the_rest_on():
    states = {1: "T"}
    err = RankStopped("m", states=states, stuck=(1,), stacks={0: "s"}, rank=1)
    assert (err.states, err.stuck, err.stacks, err.rank) == (states, (1,), {0: "s"}, 1)
    assert err.states is states
    bare = RankStopped("m")
    assert (bare.states, bare.stuck, bare.stacks) == ({}, (), {})
    assert RankStopped("m", states={}).states == {}


def test_mismatched_options_keeps_differ_and_defaults_to_an_empty_one():
    differ = {"--seed": ("1", "2")}
    assert MismatchedOptions("m", differ=differ).differ is differ
    assert MismatchedOptions("m").differ == {}
    assert MismatchedOptions("m", differ={}).differ == {}


def test_corpus_errors_keep_their_fields():
    err = CorruptCorpusEntry("m", path="c.json", field="seed")
    assert (err.path, err.field) == ("c.json", "seed")
    assert (CorruptCorpusEntry("m").path, CorruptCorpusEntry("m").field) == (None, None)
    nw = CorpusNotWritable("m", directory="/c", reason="read-only")
    assert (nw.directory, nw.reason) == ("/c", "read-only")
    assert (CorpusNotWritable("m").directory, CorpusNotWritable("m").reason) == (None, None)


def test_user_code_errors_keep_their_fields():
    err = UserCodeError("m", role="splitter", function="m:f", user_traceback="tb")
    assert (err.role, err.function, err.user_traceback) == ("splitter", "m:f", "tb")
    mod = ModifiedInput("m", rank=2, name="w", role="resharder", function="m:g",
                        user_traceback="tb2")
    assert (mod.rank, mod.name) == (2, "w")
    assert (mod.role, mod.function, mod.user_traceback) == ("resharder", "m:g", "tb2")
    bare = ModifiedInput("m")
    assert (bare.rank, bare.name, bare.role) == (None, None, None)


def test_geometry_errors_keep_their_fields():
    err = GeometryTooLarge("m", field="d_model", estimate=10, flops=20)
    assert (err.field, err.estimate, err.flops) == ("d_model", 10, 20)
    big = CorpusEntryTooLarge("too big", path="e.json", field="vocab", estimate=3, flops=4)
    assert (big.path, big.field, big.estimate, big.flops) == ("e.json", "vocab", 3, 4)
    assert (str(big), big.args) == ("too big", ("too big",))
    assert isinstance(big, CorruptCorpusEntry) and isinstance(big, GeometryTooLarge)


def test_invalid_cover_and_checkpoint_errors_keep_their_fields():
    err = InvalidCover("m", param="w", rank=1, box=((0, 2),))
    assert (err.param, err.rank, err.box) == ("w", 1, ((0, 2),))
    assert CheckpointError("m", path="a.safetensors").path == "a.safetensors"
    assert CheckpointError("m").path is None
    unsafe = UnsafeFile("m", path="/d/x", entry="../x")
    assert (unsafe.path, unsafe.entry, str(unsafe)) == ("/d/x", "../x", "m")
    assert (UnsafeFile("m").path, UnsafeFile("m").entry) == (None, None)


# -- UnknownMutation's str is its message, not KeyError's quoted repr


def test_unknown_mutation_reads_as_its_message_unquoted():
    assert str(UnknownMutation("no mutation 'x'; known: a, b")) == "no mutation 'x'; known: a, b"
    assert str(UnknownMutation("first", "second")) == "first"
    assert str(UnknownMutation()) == ""
    # the twin: a plain KeyError quotes its message
    assert str(KeyError("no mutation")) == "'no mutation'"


# -- InvalidNumber's checks


@pytest.mark.parametrize("value", [1, 2, 10**20])
def test_count_accepts_an_int_from_one(value):
    assert InvalidNumber.count("--n", value) == value


@pytest.mark.parametrize("value, minimum", [(0, 0), (5, 5), (-3, -3)])
def test_count_accepts_its_minimum(value, minimum):
    assert InvalidNumber.count("--n", value, minimum=minimum) == value


@pytest.mark.parametrize("value, shown", [
    (0, "0"), (-1, "-1"), (True, "True"), (False, "False"), (1.0, "1.0"), ("3", "'3'"),
    (None, "None")])
def test_count_refuses_by_name_and_value(value, shown):
    with pytest.raises(InvalidNumber) as err:
        InvalidNumber.count("--geometries", value)
    assert str(err.value) == f"--geometries must be an int >= 1, got {shown}"


def test_count_names_its_minimum():
    with pytest.raises(InvalidNumber, match=r"^--random must be an int >= 2, got 1$"):
        InvalidNumber.count("--random", 1, minimum=2)


@pytest.mark.parametrize("value", [1, 0.5, 1e-300, 3, 1e300])
def test_positive_accepts_a_finite_number_above_zero_as_a_float(value):
    got = InvalidNumber.positive("--minutes", value)
    assert got == float(value) and type(got) is float


@pytest.mark.parametrize("value, shown", [
    (0, "0"), (0.0, "0.0"), (-1, "-1"), (-0.5, "-0.5"), (math.nan, "nan"),
    (math.inf, "inf"), (-math.inf, "-inf"), (True, "True"), (False, "False"), ("1", "'1'"),
    (None, "None")])
def test_positive_refuses_by_name_and_value(value, shown):
    with pytest.raises(InvalidNumber) as err:
        InvalidNumber.positive("--minutes", value)
    assert str(err.value) == f"--minutes must be a finite number > 0, got {shown}"


@pytest.mark.parametrize("value", [0, 1, 2**63 - 1, 12345])
def test_seed_accepts_zero_to_two_to_the_63_minus_one(value):
    assert InvalidNumber.seed("--seed", value) == value
    assert InvalidNumber.SEED_MAX == 2**63 - 1


@pytest.mark.parametrize("value, shown", [
    (-1, "-1"), (2**63, str(2**63)), (True, "True"), (False, "False"), (1.0, "1.0"),
    ("1", "'1'"), (None, "None")])
def test_seed_refuses_by_name_and_value(value, shown):
    with pytest.raises(InvalidNumber) as err:
        InvalidNumber.seed("--seed", value)
    assert str(err.value) == f"--seed must be an int in 0..2^63-1, got {shown}"
