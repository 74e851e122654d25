"""The random-geometry floors under every CPU kernel set: each committed sample's floor is
re-measured under each kernel set this machine runs (``ATEN_CPU_CAPABILITY``, one process
each), the worst is kept, never lowered, and the fuzz rule is re-derived from it; a re-measure
here reproduces the recorded figure of the running kernel set bit for bit."""

import copy
import json

import pytest

from weight_sync_bench.cli import main
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.fuzz.floor import remeasure_floors
from weight_sync_bench.tolerance.artifacts import (
    artifact_path,
    cpu_vendor,
    kernel_set_label,
    running_kernel_set,
)
from weight_sync_bench.tolerance.kernels import merge_kernel_sets
from weight_sync_bench.tolerance.sampled import (
    choose_rule,
    kernel_set_figures,
    load_random_floor,
    rule_from,
)

ENV = {"cpu_capability": "X"}


def _artifact(floors, scale=1.0):
    samples = [{"geometry": {"d_model": 8 * (i + 1)}, "seed": 0, "degree": 2, "floor": f,
                "scale": scale, "kills": {"m": 1.0}} for i, f in enumerate(floors)]
    chosen, figures = choose_rule(samples)
    return {"phase": "1a", "samples": samples, "chosen": chosen.name, "rules": figures}


def test_each_sample_keeps_the_worst_kernel_set_and_the_rule_is_re_derived_from_it():
    artifact = _artifact([1e-6] * 6)
    merged = merge_kernel_sets(artifact, {"A": [1e-6] * 6, "B": [1e-6] * 4 + [3e-5] * 2}, ENV)
    last = merged["samples"][-1]
    assert last["floor"] == 3e-5 and last["kernel_set"] == "B"
    assert last["by_kernel_set"] == {"A": 1e-6, "B": 3e-5} and last["floor_as_measured"] == 1e-6
    assert merged["kernel_sets"] == ["A", "B"]
    assert merged["kernel_sets_measured"]["environment"] == ENV
    # the rule follows the worst kernel set (in both halves of the held-out split):
    # 100 x 3e-5, not 100 x 1e-6 (rounded up to a power of ten for the absolute rule)
    assert rule_from(artifact).threshold(1.0) == pytest.approx(1e-4)
    assert rule_from(merged).threshold(1.0) == pytest.approx(3e-3)
    assert merged["chosen"] == rule_from(merged).name
    # twin: kernel sets that agree with the first measurement leave the rule where it was
    same = merge_kernel_sets(artifact, {"A": [1e-6] * 6, "B": [1e-6] * 6}, ENV)
    assert rule_from(same) == rule_from(artifact)


def test_a_re_measurement_never_lowers_a_floor_and_says_which_measurement_set_it():
    artifact = _artifact([4e-6] + [1e-6] * 5)
    merged = merge_kernel_sets(artifact, {"A": [2e-6] + [1e-6] * 5}, ENV)
    first = merged["samples"][0]
    assert first["floor"] == 4e-6 and first["kernel_set"] == "as measured"
    # merged again, the first measurement stays the one recorded before any re-measure
    again = merge_kernel_sets(merged, {"A": [1e-7] * 6}, ENV)
    assert again["samples"][0]["floor_as_measured"] == 4e-6 and again["samples"][0]["floor"] == 4e-6


def test_a_re_measurement_on_another_cpu_vendor_keeps_the_first_vendors_figures():
    """MKL and oneDNN dispatch by vendor: the floors re-measured on an Intel CPU join the AMD
    CPU's (each kernel set named with its vendor), worst kept; re-measured again on one
    vendor, that vendor's figures are replaced and the other's kept."""
    amd, intel = {"cpu_vendor": "AuthenticAMD"}, {"cpu_vendor": "GenuineIntel"}
    first = merge_kernel_sets(_artifact([1e-6] * 6), {"AuthenticAMD/AVX2": [2e-6] + [1e-6] * 5},
                              amd)
    both = merge_kernel_sets(first, {"GenuineIntel/AVX2": [1e-6] * 5 + [5e-6]}, intel)
    assert both["kernel_sets"] == ["AuthenticAMD/AVX2", "GenuineIntel/AVX2"]
    assert both["machines"] == {"AuthenticAMD": amd, "GenuineIntel": intel}
    head, tail = both["samples"][0], both["samples"][-1]
    assert (head["floor"], head["kernel_set"]) == (2e-6, "AuthenticAMD/AVX2")
    assert (tail["floor"], tail["kernel_set"]) == (5e-6, "GenuineIntel/AVX2")
    assert rule_from(both).threshold(1.0) == pytest.approx(1e-3)  # 100 x 5e-6, held out too
    again = merge_kernel_sets(both, {"GenuineIntel/AVX2": [1e-6] * 6}, intel)
    assert again["kernel_sets"] == both["kernel_sets"]
    assert again["samples"][0]["by_kernel_set"] == {"AuthenticAMD/AVX2": 2e-6,
                                                    "GenuineIntel/AVX2": 1e-6}
    assert again["samples"][-1]["floor"] == 1e-6  # Intel's 5e-6 replaced by its re-measure
    # a committed artifact of before the vendor was recorded: its sets ran on the vendor its
    # re-measurement's cpu_model names
    older = {**merge_kernel_sets(_artifact([1e-6] * 6), {"AVX2": [1e-6] * 6}, {}),
             "kernel_sets_measured": {"environment": {"cpu_model": "AMD EPYC"}}}
    assert merge_kernel_sets(older, {"GenuineIntel/AVX2": [1e-6] * 6}, intel)["kernel_sets"] == [
        "AuthenticAMD/AVX2", "GenuineIntel/AVX2"]


def test_floors_that_do_not_match_the_samples_are_refused():
    artifact = _artifact([1e-6] * 4)
    with pytest.raises(ToleranceMismatch, match="3 floors re-measured under B for 4 samples"):
        merge_kernel_sets(artifact, {"A": [1e-6] * 4, "B": [1e-6] * 3}, ENV)
    with pytest.raises(ToleranceMismatch, match="no kernel set to merge"):
        merge_kernel_sets(artifact, {}, ENV)


def test_the_kernel_set_table_counts_only_strict_worsts_and_gives_each_sets_own_rule():
    artifact = merge_kernel_sets(_artifact([1e-6] * 6),
                                 {"A": [1e-6] * 6, "B": [1e-6] * 4 + [3e-5] * 2}, ENV)
    header, a, b, merged = kernel_set_figures(artifact)
    assert header[0] == "kernel set" and a[0] == "A" and b[0] == "B"
    assert a[3] == "0" and b[3] == "2"  # ties count for neither
    assert a[4] == "0.0001" and b[4].startswith("0.003") and merged[4] == b[4]


@pytest.mark.parametrize("phase", ["1a", "1b"])
def test_the_committed_random_floors_carry_the_kernel_sets_of_the_other_floors(phase):
    artifact = load_random_floor(phase)
    phase_floor = json.loads(artifact_path(phase).read_text())
    assert artifact["kernel_sets"] == phase_floor["kernel_sets"]  # measured under every set
    assert all("/" in k for k in artifact["kernel_sets"])  # each on a named CPU vendor
    assert set(artifact["machines"]) == {k.split("/")[0] for k in artifact["kernel_sets"]}
    for s in artifact["samples"]:
        assert set(s["by_kernel_set"]) == set(artifact["kernel_sets"])
        assert s["floor"] == max(s["floor_as_measured"], *s["by_kernel_set"].values())
    assert artifact["kernel_sets_measured"]["environment"]["cpu_model"]
    # what the fuzz reads is the rule of the merged floors
    assert artifact["chosen"] == rule_from(artifact).name


def test_committed_samples_re_measured_here_reproduce_the_running_kernel_sets_figures():
    artifact = load_random_floor("1a")
    here = running_kernel_set()  # the kernel set on this CPU vendor: MKL dispatches by both
    if here not in artifact["kernel_sets"]:
        pytest.skip(f"this process runs {here}, not among {artifact['kernel_sets']}")
    part = {**artifact, "samples": artifact["samples"][:40]}
    floors = remeasure_floors(part)
    assert floors == [s["by_kernel_set"][here] for s in part["samples"]]
    # twin: the comparison is not vacuous: other seeds give other floors
    reseeded = {**part, "samples": [{**s, "seed": s["seed"] + 1} for s in part["samples"]]}
    assert remeasure_floors(reseeded) != floors


def test_wsb_floor_re_measures_an_artifacts_samples_under_every_kernel_set(tmp_path, capsys,
                                                                          monkeypatch):
    # one kernel set, DEFAULT, without probing the other candidates (a process each, 2.4 s):
    # the merge itself is tested above on any number of sets. DEFAULT, not the running one:
    # its committed figures differ from the vectorised sets' on these samples (on both
    # vendors), so matching them shows the process ran under the kernel set it was given
    sets = ["default"]
    monkeypatch.setattr("weight_sync_bench.tolerance.kernels.available", lambda: sets)
    committed = load_random_floor("1a")
    small = copy.deepcopy({**committed, "samples": committed["samples"][:6]})
    small.pop("kernel_sets")
    for s in small["samples"]:
        s.pop("by_kernel_set"), s.pop("kernel_set")
    source, out = tmp_path / "small.json", tmp_path / "merged.json"
    source.write_text(json.dumps(small))
    assert main(["floor", "--kernel-sets", "all", "--from", str(source), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["kernel_sets"] == [kernel_set_label(cpu_vendor(), k.upper()) for k in sets]
    assert [s["by_kernel_set"] for s in merged["samples"]] == [
        {k: s["by_kernel_set"][k] for k in merged["kernel_sets"]}
        for s in committed["samples"][:6]]
    printed = capsys.readouterr().out
    assert "rule from it alone" in printed and f"wrote {out}" in printed
    assert json.loads(source.read_text()) == small  # the source is read, never rewritten


@pytest.mark.parametrize("argv, message", [
    (["floor", "--kernel-sets", "current"], "pass --random N to measure new samples"),
    (["floor", "--kernel-sets", "all", "--search", "5", "--out", "x.json"],
     "--search applies to --random N"),
    (["floor", "--random", "3", "--from", "x.json", "--out", "y.json"],
     "--from re-measures an existing artifact's samples"),
])
def test_a_re_measurement_asked_for_wrongly_is_a_usage_error(argv, message, capsys, tmp_path,
                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before anything was measured or written
