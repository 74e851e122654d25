"""``wsb floor random | replicated-kv | moe``'s own code (issue 30, the mutation pass over
``cli/floor_samples.py``): new samples or an artifact's samples measured again, in this
process or under every kernel set, what is refused before anything is drawn, where each
artifact goes and what is printed.

The sampling, the re-measurements, the merges and the tables are stood in (``Rig``): each
records what it was handed and returns a marked dict, so the flow between them is what
these tests pin, in milliseconds. The real sampling is ``tests/fuzz``'s
(``test_floor.py``, ``test_moe_floor.py``, ``test_replicated_kv_floor.py``) and the real
merges ``tests/tolerance``'s; ``tests/cli/test_floor.py`` runs the command end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.floor_cli import Line, parse
from weight_sync_bench.cli import floor_report as report
from weight_sync_bench.cli import floor_samples as S
from weight_sync_bench.cli.output import EXIT_OK, Ticker
from weight_sync_bench.errors import ArtifactProtected, WsbError
from weight_sync_bench.fuzz import floor as fuzz_floor
from weight_sync_bench.fuzz import runner
from weight_sync_bench.fuzz.floor import SampleProgress
from weight_sync_bench.model.config import TOY, TOY_KV4
from weight_sync_bench.tolerance import kernels


class Rig:
    """The stand-ins; ``calls`` lists (name, args, kwargs) in the order they ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.kept: list[str] = []
        self.tmp = tmp_path
        self.per_set = [{"floors": {"GenuineIntel/DEFAULT": [1.0]}},
                        {"floors": {"GenuineIntel/AVX2": [2.0]}}]
        rec = self.recorder
        for module, name, value in (
                (fuzz_floor, "remeasure_floors", {"floors": "random here"}),
                (fuzz_floor, "remeasure_moe_floors", {"floors": "moe here"}),
                (fuzz_floor, "remeasure_replicated_floors", {"floors": "kv here"}),
                (fuzz_floor, "draw_replicated_geometries", "KV GEOMETRIES"),
                (fuzz_floor, "measure_replicated_kv", {"id": "drawn kv", "samples": []}),
                (fuzz_floor, "measure_moe", {"id": "drawn moe", "samples": []}),
                (runner, "draw_floor_cases", (["CASE"], 1234)),
                (runner, "search_worst_floors", ["SEARCHED"]),
                (runner, "draw_moe_cases", "MOE CASES"),
                (kernels, "merge_kernel_sets", {"id": "merged random", "kernel_sets": ["K"]}),
                (kernels, "merge_moe", {"id": "merged moe"}),
                (kernels, "merge_replicated_kv", {"id": "merged kv"}),
                (S, "phase_forward", "FORWARD"),
                (S, "apply_deadline", None),
                (S, "environment", {"here": True}),
                (S, "load_random_floor", {"rule": "in force"}),
                (S, "load_replicated_kv", None),
                (S, "load_moe", None),
                (S, "rule_from", "RULE"),
                (report, "plot", None)):
            monkeypatch.setattr(module, name, rec(name, value))
        monkeypatch.setattr(fuzz_floor, "measure_random", self.sample)
        monkeypatch.setattr(kernels, "sample_floors", lambda a: a["floors"])
        monkeypatch.setattr(kernels, "kept_vendors", self.kept_vendors)
        monkeypatch.setattr(S, "each_kernel_set", self.each_kernel_set)
        monkeypatch.setattr(S, "cpu_vendor", lambda: "GenuineIntel")
        monkeypatch.setattr(S, "running_kernel_set",
                            lambda here=None: rec("running", None)(here) or "GenuineIntel/AVX2")
        for name in ("artifact_path", "plot_path", "replicated_kv_path", "moe_path"):
            monkeypatch.setattr(S, name, self.path(name))
        for name in ("rules_table", "moe_table", "validation_table", "kernel_sets_table"):
            monkeypatch.setattr(report, name, lambda a, name=name: f"[{name} of {a['id']}]")
        monkeypatch.setattr(report, "compared",
                            lambda kind, old, new: [(f"{kind} figure", old["id"], new["id"])])

    def recorder(self, name, value):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return value
        return call

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def of(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self.calls if n == name]

    def path(self, name):
        def where(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self.tmp / "committed" / f"{name}.json"
        return where

    def sample(self, cases, **kwargs):
        self.calls.append(("sample", (cases,), kwargs))
        yield SampleProgress(1, 2, TOY)
        yield SampleProgress(2, 2, TOY_KV4)
        yield {"id": "sampled"}

    def kept_vendors(self, old, vendor, *, force, where):
        self.calls.append(("kept_vendors", (old, vendor), {"force": force, "where": where}))
        return self.kept

    def each_kernel_set(self, argv, scratch, line):
        self.calls.append(("each_kernel_set", (list(argv), scratch, line), {}))
        self.scratch = scratch
        self.source_then = {p.name: p.is_file() for p in scratch.iterdir()}
        return self.per_set


@pytest.fixture
def rig(monkeypatch, tmp_path):
    return Rig(monkeypatch, tmp_path)


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def rows(printed: str) -> list[list[str]]:
    return [line.split() for line in printed.splitlines()]


# -- random: new samples


def test_new_samples_are_drawn_sampled_and_written_with_their_plot(rig, tmp_path, capsys):
    out = tmp_path / "r.json"
    line = Line()
    args = parse("random", "--random", "3", "--seed", "9", "--out", str(out),
                 "--kernel-sets", "current", "--phase", "1b", "--deadline", "30")
    assert S.measure_random(args, line) == EXIT_OK
    assert rig.of("apply_deadline") == [((30.0, True), {})]
    assert rig.of("phase_forward") == [(("1b",), {})]
    assert rig.of("draw_floor_cases") == [((3,), {"seed": 9})]
    ((cases,), kwargs), = rig.of("sample")
    assert cases == ["CASE"] and kwargs == {
        "searched": [], "phase": "1b", "forward": "FORWARD", "profile": "wsb-generate",
        "hypothesis_seed": 1234, "search_examples": 0}
    assert "search_worst_floors" not in rig.names()
    assert read(out) == {"id": "sampled"}
    assert rig.of("plot") == [(({"id": "sampled"}, out.with_suffix(".png")), {})]
    assert [text.split(",")[0] for text in line.shown] == [
        f"floor sample d_model={TOY.d_model} layers={TOY.n_layers} kv_heads={TOY.n_kv_heads}: 1/2",
        f"floor sample d_model={TOY_KV4.d_model} layers={TOY_KV4.n_layers} "
        f"kv_heads={TOY_KV4.n_kv_heads}: 2/2"]
    assert line.closed == 1
    assert capsys.readouterr().out == (
        f"[rules_table of sampled]\nwrote {out} and {out.with_suffix('.png')}\n")


def test_a_search_keeps_its_worst_examples_beside_the_draw(rig, tmp_path):
    line = Line()
    S.measure_random(parse("random", "--random", "2", "--search", "8", "--keep", "3",
                           "--out", str(tmp_path / "r.json"), "--kernel-sets", "current"), line)
    assert rig.of("search_worst_floors") == [((8,), {"keep": 3, "seed": 1234, "phase": "1a",
                                                     "forward": "FORWARD"})]
    kwargs = rig.of("sample")[0][1]
    assert kwargs["searched"] == ["SEARCHED"] and kwargs["search_examples"] == 8
    assert line.shown[0] == "searching 8 examples for the worst floor / max|logit| ..."
    assert rig.of("apply_deadline") == [((None, False), {})]


def test_written_with_write_the_committed_artifact_and_plot_are_replaced(rig, tmp_path):
    S.measure_random(parse("random", "--random", "2", "--write", "--kernel-sets", "current"),
                     Line())
    assert rig.of("artifact_path") == [(("1a",), {"kind": "random_floor"})]
    assert rig.of("plot_path") == [(("1a",), {})]
    assert read(tmp_path / "committed" / "artifact_path.json") == {"id": "sampled"}
    assert rig.of("plot")[0][0][1] == tmp_path / "committed" / "plot_path.json"


def test_new_samples_under_every_kernel_set_are_each_measured_again_and_merged(rig, tmp_path,
                                                                             capsys):
    out = tmp_path / "r.json"
    line = Line()
    S.measure_random(parse("random", "--random", "2", "--out", str(out)), line)
    ((argv, scratch, seen_line), _), = rig.of("each_kernel_set")
    assert argv == ["random", "--phase", "1a", "--from", str(scratch / "fresh.json")]
    assert seen_line is line and scratch.name.startswith("wsb-floor-")
    assert rig.source_then == {"fresh.json": True} and not scratch.exists()
    ((measured, floors, here), _), = rig.of("merge_kernel_sets")
    assert measured == {"id": "sampled"} and here == {"here": True}
    assert floors == {"GenuineIntel/DEFAULT": [1.0], "GenuineIntel/AVX2": [2.0]}
    assert read(out) == {"id": "merged random", "kernel_sets": ["K"]}
    assert capsys.readouterr().out == (
        "[rules_table of merged random]\n\n[kernel_sets_table of merged random]\n"
        f"wrote {out} and {out.with_suffix('.png')}\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["--random", "2", "--from", "x.json"], "--from re-measures an existing artifact's "
     "samples: it takes --kernel-sets all, not --random"),
    (["--random", "1"], "--random needs at least 2 geometries, got 1"),
    (["--random", "2", "--search", "3", "--keep", "4"], "--keep 4 > --search 3: cannot keep "
     "more of the searched examples than were tried")])
def test_new_samples_refuse_what_cannot_be_drawn(rig, tmp_path, argv, message):
    with pytest.raises(WsbError) as caught:
        S.measure_random(parse("random", *argv, "--out", str(tmp_path / "r.json")), Line())
    assert str(caught.value) == message
    assert not rig.calls


def test_keep_equal_to_search_is_drawn(rig, tmp_path):
    assert S.measure_random(parse("random", "--random", "2", "--search", "3", "--keep", "3",
                                  "--out", str(tmp_path / "r.json"), "--kernel-sets",
                                  "current"), Line()) == EXIT_OK


@pytest.mark.parametrize(("old", "equal", "message"), [
    # without --search, --keep counts nothing
    ({"geometries": 5}, {"geometries": 3}, "holds 5 geometries (random + searched); this "
     "measurement would have 3:"),
    # no count of random ones: 0 of them
    ({"searched": 4}, {"searched": 3}, "holds 4 geometries (random + searched); this "
     "measurement would have 3:"),
    # no count of searched ones
    ({"geometries": 4}, {"geometries": 3}, "holds 4 geometries (random + searched); this "
     "measurement would have 3:")])
def test_the_sample_size_replaced_counts_what_each_side_holds(rig, tmp_path, old, equal,
                                                             message):
    argv = ["--random", "3"]
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"id": "old", **old}))
    with pytest.raises(ArtifactProtected) as caught:
        S.measure_random(parse("random", *argv, "--out", str(out)), Line())
    assert message in str(caught.value)
    assert S.measure_random(parse("random", *argv, "--out", str(out), "--kernel-sets",
                                  "current", "--force"), Line()) == EXIT_OK
    out.write_text(json.dumps({"id": "old", **equal}))  # as many: not refused
    assert S.measure_random(parse("random", *argv, "--out", str(out), "--kernel-sets",
                                  "current"), Line()) == EXIT_OK


def test_fewer_geometries_than_the_artifact_holds_need_force(rig, tmp_path):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"id": "old", "geometries": 3, "searched": 2}))
    with pytest.raises(ArtifactProtected, match=f"{out} holds 5 geometries \\(random \\+ "
                       "searched\\); this measurement would have 4: pass --force"):
        S.measure_random(parse("random", "--random", "2", "--search", "4", "--keep", "2",
                               "--out", str(out), "--kernel-sets", "current"), Line())
    assert "draw_floor_cases" not in rig.names()
    # as many, counting the kept searched examples: drawn
    S.measure_random(parse("random", "--random", "3", "--search", "4", "--keep", "2",
                           "--out", str(out), "--kernel-sets", "current"), Line())
    assert rig.of("draw_floor_cases")


def test_a_replaced_artifact_is_compared_and_its_vendors_asked_first(rig, tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"id": "old", "geometries": 2}))
    S.measure_random(parse("random", "--random", "2", "--out", str(out), "--kernel-sets",
                           "current", "--force"), Line())
    assert rig.of("kept_vendors") == [(({"id": "old", "geometries": 2}, "GenuineIntel"),
                                       {"force": True, "where": str(out)})]
    assert rig.names().index("kept_vendors") < rig.names().index("draw_floor_cases")
    printed = capsys.readouterr().out
    assert "\n\n  " in printed and "replaced (r.json)  new" in printed
    assert "random figure  old" in printed and "sampled" in printed


def test_new_samples_over_other_vendors_figures_are_refused(rig, tmp_path):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"id": "old"}))
    rig.kept = ["AuthenticAMD", "Arm"]
    with pytest.raises(ArtifactProtected) as caught:
        S.measure_random(parse("random", "--random", "2", "--out", str(out)), Line())
    assert str(caught.value) == (
        f"{out} holds measurements on AuthenticAMD, Arm, which new samples would drop: "
        f"measure its samples here with `wsb floor random --from {out} --kernel-sets all` "
        "(they keep the other vendors' figures), or pass --force to replace them")
    assert "draw_floor_cases" not in rig.names()


def test_without_out_or_write_nothing_committed_is_replaced(rig):
    with pytest.raises(ArtifactProtected, match="this measurement: would replace"):
        S.measure_random(parse("random", "--random", "2"), Line())
    with pytest.raises(ArtifactProtected, match="re-measuring the floors: would replace"):
        S.measure_random(parse("random"), Line())


# -- random: an artifact's samples measured again


def test_an_artifacts_samples_are_measured_again_under_every_kernel_set(rig, tmp_path, capsys):
    source, out = tmp_path / "src.json", tmp_path / "r.json"
    source.write_text(json.dumps({"id": "source"}))
    line = Line()
    assert S.measure_random(parse("random", "--from", str(source), "--out", str(out),
                                  "--phase", "1b", "--deadline", "5"), line) == EXIT_OK
    assert rig.of("load_random_floor")[0] == (("1b", source), {})
    assert rig.of("apply_deadline") == [((5.0, True), {})]
    ((argv, scratch, seen_line), _), = rig.of("each_kernel_set")
    assert argv == ["random", "--phase", "1b", "--from", str(source)]
    assert seen_line is line and scratch.name.startswith("wsb-floor-") and not scratch.exists()
    ((measured, floors, here), _), = rig.of("merge_kernel_sets")
    assert measured == {"id": "source"} and set(floors) == {"GenuineIntel/DEFAULT",
                                                          "GenuineIntel/AVX2"}
    assert read(out)["id"] == "merged random"
    assert rig.of("plot")[0][0][1] == out.with_suffix(".png")
    printed = capsys.readouterr().out
    assert printed.startswith("[rules_table of merged random]\n")
    assert printed.endswith(f"wrote {out} and {out.with_suffix('.png')}\n")
    # over an artifact there: compared side by side
    out.write_text(json.dumps({"id": "old"}))
    S.measure_random(parse("random", "--from", str(source), "--out", str(out)), line)
    assert ["random", "figure", "old", "merged", "random"] in rows(capsys.readouterr().out)


def test_the_committed_artifacts_samples_by_default(rig, tmp_path):
    committed = tmp_path / "committed" / "artifact_path.json"
    committed.parent.mkdir()
    committed.write_text(json.dumps({"id": "committed"}))
    S.measure_random(parse("random", "--write", "--phase", "1b"), Line())
    assert rig.of("artifact_path") == [(("1b",), {"kind": "random_floor"})] * 2  # from, to
    assert rig.of("load_random_floor")[0] == (("1b", committed), {})
    assert rig.of("each_kernel_set")[0][0][0] == ["random", "--phase", "1b", "--from",
                                                   str(committed)]
    assert read(committed)["id"] == "merged random"
    assert rig.of("plot_path") == [(("1b",), {})]
    assert rig.of("plot")[0][0][1] == tmp_path / "committed" / "plot_path.json"


def test_a_kernel_sets_share_is_measured_here_and_merged_into_the_source(rig, tmp_path,
                                                                         capsys):
    source, out = tmp_path / "src.json", tmp_path / "r.json"
    source.write_text(json.dumps({"id": "source"}))
    line = Line()
    S.measure_random(parse("random", "--from", str(source), "--out", str(out),
                           "--kernel-sets", "current", "--phase", "1b"), line)
    assert rig.of("phase_forward") == [(("1b",), {})]
    ((measured,), kwargs), = rig.of("remeasure_floors")
    assert measured == {"id": "source"} and kwargs["forward"] == "FORWARD"
    assert isinstance(kwargs["progress"], Ticker) and kwargs["progress"].line is line
    ((measured, floors, here), _), = rig.of("merge_kernel_sets")
    assert (measured, floors, here) == ({"id": "source"},
                                        {"GenuineIntel/AVX2": {"floors": "random here"}},
                                        {"here": True})
    assert [c[0] for c in rig.of("running")] == [({"here": True},)] * 2
    assert read(out)["id"] == "merged random" and line.closed == 1
    assert capsys.readouterr().out == f"kernel set GenuineIntel/AVX2; wrote {out}\n"
    assert "each_kernel_set" not in rig.names() and "plot" not in rig.names()


@pytest.mark.parametrize(("argv", "message"), [
    (["--kernel-sets", "current"], "wsb floor: pass --random N to measure new samples, or "
     "--kernel-sets all to re-measure an artifact's samples under every kernel set"),
    (["--search", "4"], "--search applies to --random N, not to a re-measurement"),
    (["--seed", "4"], "--seed applies to --random N, not to a re-measurement")])
def test_a_re_measurement_refuses_what_only_a_draw_takes(rig, tmp_path, argv, message):
    with pytest.raises(WsbError) as caught:
        S.measure_random(parse("random", *argv, "--out", str(tmp_path / "r.json")), Line())
    assert str(caught.value) == message
    assert not rig.calls


# -- replicated-kv and moe: the rule validated on other forwards


@pytest.mark.parametrize(("kind", "measure", "table", "path"), [
    ("replicated-kv", "measure_replicated_kv", "validation_table", "replicated_kv_path"),
    ("moe", "measure_moe", "moe_table", "moe_path")])
def test_a_validation_is_drawn_measured_and_written(rig, tmp_path, capsys, kind, measure,
                                                    table, path):
    out = tmp_path / "v.json"
    line = Line()
    run = S.measure_moe if kind == "moe" else S.measure_replicated
    assert run(parse(kind, "--geometries", "3", "--seed", "5", "--out", str(out),
                     "--kernel-sets", "current"), line) == EXIT_OK
    drawn = "moe" if kind == "moe" else "kv"
    assert read(out) == {"id": f"drawn {drawn}", "samples": []}
    ((cases,), kwargs), = rig.of(measure)
    assert kwargs["phase"] == "1a" and kwargs["progress"].line is line
    if kind == "moe":
        import hypothesis
        assert rig.of("draw_moe_cases") == [((3,), {"seed": 5})]
        assert cases == "MOE CASES" and kwargs["hypothesis_seed"] == 5
        assert kwargs["draw"] == ("fuzz.runner.draw_moe_cases(3, seed=5) under Hypothesis "
                                  f"{hypothesis.__version__}")
    else:
        assert rig.of("draw_replicated_geometries") == [((3, 5), {})]
        assert cases == "KV GEOMETRIES" and kwargs["seed"] == 5
    assert path not in rig.names() and "plot" not in rig.names()
    assert capsys.readouterr().out == f"[{table} of drawn {drawn}]\nwrote {out}\n"
    assert line.closed == 1
    out.write_text(json.dumps({"id": "old"}))  # over an artifact there: compared
    run(parse(kind, "--out", str(out), "--kernel-sets", "current"), line)
    assert [kind, "figure", "old", "drawn", drawn] in rows(capsys.readouterr().out)
    assert rig.of("kept_vendors")[-1][0] == ({"id": "old"}, "GenuineIntel")


@pytest.mark.parametrize(("kind", "path", "what"), [
    ("replicated-kv", "replicated_kv_path", "the replicated-KV validation"),
    ("moe", "moe_path", "the MoE validation")])
def test_a_validation_goes_to_its_committed_path_only_with_write(rig, tmp_path, kind, path,
                                                                 what):
    run = S.measure_moe if kind == "moe" else S.measure_replicated
    with pytest.raises(ArtifactProtected, match=f"measuring {what}: would replace"):
        run(parse(kind), Line())
    run(parse(kind, "--write", "--kernel-sets", "current"), Line())
    assert rig.of(path)[-1] == (("1a",), {})
    assert (tmp_path / "committed" / f"{path}.json").is_file()


@pytest.mark.parametrize(("kind", "merge"), [("replicated-kv", "merge_replicated_kv"),
                                             ("moe", "merge_moe")])
def test_a_drawn_validation_under_every_kernel_set_is_merged_under_the_rule(rig, tmp_path,
                                                                           capsys, kind,
                                                                           merge):
    out = tmp_path / "v.json"
    run = S.measure_moe if kind == "moe" else S.measure_replicated
    line = Line()
    run(parse(kind, "--out", str(out)), line)
    ((argv, scratch, seen_line), _), = rig.of("each_kernel_set")
    assert argv == [kind, "--phase", "1a", "--from", str(scratch / "artifact.json")]
    assert seen_line is line
    assert rig.source_then == {"artifact.json": True}
    assert scratch.name.startswith(f"wsb-{kind}-") and not scratch.exists()
    ((measured, floors, here, rule), _), = rig.of(merge)
    assert measured["id"].startswith("drawn") and here == {"here": True} and rule == "RULE"
    assert set(floors) == {"GenuineIntel/DEFAULT", "GenuineIntel/AVX2"}
    assert rig.of("load_random_floor") == [(("1a",), {})]
    assert rig.of("rule_from") == [(({"rule": "in force"},), {})]
    assert read(out)["id"] == f"merged {'moe' if kind == 'moe' else 'kv'}"


@pytest.mark.parametrize(("kind", "load", "remeasure", "merge"), [
    ("replicated-kv", "load_replicated_kv", "remeasure_replicated_floors",
     "merge_replicated_kv"),
    ("moe", "load_moe", "remeasure_moe_floors", "merge_moe")])
def test_a_validations_samples_are_measured_again(rig, tmp_path, capsys, kind, load,
                                                  remeasure, merge):
    source, out = tmp_path / "src.json", tmp_path / "v.json"
    source.write_text(json.dumps({"id": "source"}))
    run = S.measure_moe if kind == "moe" else S.measure_replicated
    line = Line()
    run(parse(kind, "--from", str(source), "--out", str(out), "--kernel-sets", "current"),
        line)
    assert rig.of(load) == [(("1a", source), {})]
    ((measured,), kwargs), = rig.of(remeasure)
    assert measured == {"id": "source"} and kwargs["progress"].line is line
    ((_, floors, _), _), = rig.of(merge)
    assert floors == {"GenuineIntel/AVX2": {"floors": f"{'moe' if kind == 'moe' else 'kv'} "
                                                      "here"}}
    assert capsys.readouterr().out == f"kernel set GenuineIntel/AVX2; wrote {out}\n"
    assert "kept_vendors" not in rig.names() and "each_kernel_set" not in rig.names()
    # under every kernel set: a process each, from the source
    rig.calls.clear()
    old = {"id": "old"}
    out.write_text(json.dumps(old))
    run(parse(kind, "--from", str(source), "--out", str(out)), line)
    ((argv, scratch, seen_line), _), = rig.of("each_kernel_set")
    assert argv == [kind, "--phase", "1a", "--from", str(source)] and seen_line is line
    assert scratch.name.startswith(f"wsb-{kind}-")
    printed = capsys.readouterr().out
    table = "moe_table of merged moe" if kind == "moe" else "validation_table of merged kv"
    assert printed.startswith(f"[{table}]\n")
    assert "replaced (v.json)" in printed and printed.endswith(f"wrote {out}\n")


def test_a_new_validation_over_other_vendors_is_refused_before_drawing(rig, tmp_path):
    out = tmp_path / "v.json"
    out.write_text(json.dumps({"id": "old"}))
    rig.kept = ["AuthenticAMD"]
    with pytest.raises(ArtifactProtected, match="wsb floor moe --from"):
        S.measure_moe(parse("moe", "--out", str(out)), Line())
    assert "measure_moe" not in rig.names() and "draw_moe_cases" not in rig.names()
    assert rig.of("kept_vendors") == [(({"id": "old"}, "GenuineIntel"),
                                       {"force": False, "where": str(out)})]
