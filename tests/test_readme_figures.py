"""The README's measured figures equal the committed artifacts they cite.

Each check below reads a figure the README states (a regular expression around the sentence
that states it) and the artifact that figure comes from (``tolerance/*.json``,
``mutation/results.json``, ``campaigns/*.json``, ``corpus/``), and returns the differences as
messages. A re-measurement that changes a figure fails here until the README says the new
one. The twins run the same checks on a copy of the README with one figure changed.

A figure matches when the artifact's value, rounded to as many significant digits as the
README writes, is the README's number (``162x`` for 161.62; ``1.19e-6`` for 1.1921e-6).
Reads files only: no model is built, nothing is measured.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.documentation import documentation

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOLERANCE = ROOT / "tolerance"


def n(name: str) -> str:
    """A named group for one figure as the README writes it (``1,011``, ``27.7``, ``1.19e-6``)."""
    return rf"(?P<{name}>[0-9][0-9,]*(?:\.[0-9]+)?(?:e-?[0-9]+)?)"


pytestmark = pytest.mark.skipif(not (TOLERANCE / "phase1a.json").is_file(),
                                reason="no checkout: the committed artifacts are not here")


def same_figure(stated: str, value: float) -> bool:
    """``stated`` (``"162"``, ``"27.7"``, ``"1.19e-6"``, ``"1,011"``) is ``value`` rounded to
    the significant digits ``stated`` shows (every digit of an integer counts)."""
    text = stated.replace(",", "")
    mantissa = text.lower().split("e")[0].replace(".", "").lstrip("0")
    digits = max(len(mantissa), 1)
    return float(text) == float(f"{value:.{digits}g}")


def _flat(text: str) -> str:
    """The README with line breaks and runs of spaces as single spaces (sentences wrap)."""
    return re.sub(r"\s+", " ", text)


def compare(text: str, pattern: str, expected: dict[str, float | str]) -> list[str]:
    """The figures of ``pattern``'s named groups in ``text`` against ``expected``: one message
    per figure that differs (numbers by ``same_figure``, names exactly), or one saying the
    sentence is gone."""
    found = re.search(pattern, _flat(text))
    if found is None:
        return [f"the README no longer states /{pattern}/"]
    wrong = []
    for name, want in expected.items():
        got = found.group(name)
        ok = got == want if isinstance(want, str) else same_figure(got, want)
        if not ok:
            wrong.append(f"{name}: the README says {got}, the artifact {want}")
    return wrong


@functools.lru_cache(maxsize=None)
def _artifact(path: Path) -> dict[str, Any]:
    """The committed file, parsed once per test process (read only: each check and its twins
    read the same megabytes of floors)."""
    return json.loads(path.read_text())


# --- the random-geometry fuzz rules: tolerance/random_floor_<phase>.json -------------------

def fuzz_rule_mismatches(text: str) -> list[str]:
    wrong = []
    for phase in ("1a", "1b"):
        art = _artifact(TOLERANCE / f"random_floor_{phase}.json")
        rule = next(r for r in art["rules"] if r["rule"] == art["chosen"])
        held = next(h for h in art["holdout"] if h["rule"] == art["chosen"])
        pattern = (rf"Phase {phase}: `(?P<rule>\w+)`, {n('value')}"
                   rf"[^(]*\(`tolerance/random_floor_{phase}\.json`: "
                   rf"{n('samples')} samples, "
                   rf"{n('fp')} false positives, smallest headroom "
                   rf"{n('headroom')}x, held-out "
                   rf"{n('held')}x over "
                   rf"{n('held_samples')} samples, smallest kill ratio "
                   rf"{n('kill')}x")
        wrong += [f"phase {phase}: {m}" for m in compare(text, pattern, {
            "rule": art["chosen"], "value": rule["value"], "samples": len(art["samples"]),
            "fp": rule["false_positives"], "headroom": rule["min_headroom"],
            "held": held["min_headroom"], "held_samples": held["samples"],
            "kill": rule["min_kill_ratio"]})]
        # what the README claims of the chosen rule: it keeps the safety factor held out
        if held["min_headroom"] < art["safety"] or held["false_positives"]:
            wrong.append(f"phase {phase}: the chosen rule keeps {held['min_headroom']:.3g}x "
                         f"held out, below the artifact's safety {art['safety']}x")
    art = _artifact(TOLERANCE / "random_floor_1a.json")
    runner_up = next(r for r in art["rules"] if r["rule"] == "relative_pow10")
    held = next(h for h in art["holdout"] if h["rule"] == "relative_pow10")
    wrong += compare(text, rf"`relative_pow10`, {n('value')} x max \|reference logit\|, "
                           rf"keeps {n('held')}x held out but a smaller kill ratio, "
                           rf"{n('kill')}x, so it is not chosen",
                     {"value": runner_up["value"], "held": held["min_headroom"],
                      "kill": runner_up["min_kill_ratio"]})
    chosen = next(r for r in art["rules"] if r["rule"] == art["chosen"])
    if art["chosen"] != "relative" or chosen["min_kill_ratio"] <= runner_up["min_kill_ratio"]:
        wrong.append(f"phase 1a: the README says `relative` is chosen for its larger kill "
                     f"ratio; the artifact chose {art['chosen']}")
    return wrong


# --- the mutation-testing scores: mutation/results.json ------------------------------------

def mutation_mismatches(text: str) -> list[str]:
    totals = _artifact(ROOT / "mutation" / "results.json")["totals"]
    before, after = totals["before"], totals["after"]
    pattern = (rf"{n('tried0')} mutants scored "
               rf"{n('score0')}% with the tests of then; with the tests "
               rf"added for the survivors, {n('tried1')} mutants scored "
               rf"{n('score1')}% \({n('killed')} "
               rf"killed, {n('timeout')} timeouts, "
               rf"{n('survived')} survivors")
    wrong = compare(text, pattern, {
        "tried0": before["tried"], "score0": before["score"], "tried1": after["tried"],
        "score1": after["score"], "killed": after["killed"], "timeout": after["timeout"],
        "survived": after["survived"]})
    runs = _artifact(ROOT / "mutation" / "results.json")
    diagnosis = runs["stop20_diagnosis"]["totals_after"]["weight_sync_bench.check.diagnosis"]
    step = runs["stop20_step"]["totals_after"]["weight_sync_bench.training.step"]
    return wrong + compare(text, rf"comparison\) {n('dk')} of {n('dt')} killed, `step.py` "
                                 rf"\(the training check's copies cut\) {n('sk')} of {n('st')}",
                           {"dk": diagnosis["killed"], "dt": diagnosis["tried"],
                            "sk": step["killed"], "st": step["tried"]})


# --- the committed floors: tolerance/phase1a*.json, tolerance/geometry/ --------------------

def floor_mismatches(text: str) -> list[str]:
    wrong = compare(text, rf"measures that floor \({n('reps')} model and "
                          r"token seeds per destination cell: the artifact's `repetitions`\)",
                    {"reps": _artifact(TOLERANCE / "phase1a.json")["repetitions"]})
    wrong += compare(text, rf"worst {n('bf16')} and "
                           rf"{n('fp16')} on TOY / TOY_KV4",
                     {"bf16": _artifact(TOLERANCE / "phase1a_bf16.json")["worst_abs"],
                      "fp16": _artifact(TOLERANCE / "phase1a_fp16.json")["worst_abs"]})
    llama = sorted((TOLERANCE / "geometry").glob("llama3_8b-1a-fp32-*.json"))
    if len(llama) != 1:
        return [*wrong, f"expected one committed llama3_8b floor, found {len(llama)}"]
    wrong += compare(text, rf"--layers 1 --repetitions 2`: worst "
                           rf"{n('worst')} over t = 1, 2, 4, 8",
                     {"worst": _artifact(llama[0])["worst_abs"]})
    # phase 1a's worst on each CPU vendor, every kernel set
    phase = _artifact(TOLERANCE / "phase1a.json")
    by_vendor = {v: max(w for c in phase["cells"] for k, w in c["by_kernel_set"].items()
                        if k.startswith(v + "/")) for v in ("AuthenticAMD", "GenuineIntel")}
    wrong += compare(text, rf"\(phase 1a's worst: {n('amd')} on the AMD EPYC the floors were "
                           rf"first measured on, {n('intel')} on an Intel Xeon\)",
                     {"amd": by_vendor["AuthenticAMD"], "intel": by_vendor["GenuineIntel"]})
    # the Limits line: which floors were measured on which CPU vendors, under which kernel sets
    stated = re.search(r"the floors of `tolerance/\*\.json` on (?P<vendors>\w+) and "
                       r"(?P<vendor>\w+) CPUs, each under (?P<sets>[A-Z0-9, ]+?) and "
                       r"(?P<last>[A-Z0-9]+) \(their `kernel_sets` field", _flat(text))
    if stated is None:
        return [*wrong, "the README no longer states the kernel sets of the floors"]
    sets = [f"{vendor}/{k}" for vendor in (stated.group("vendors"), stated.group("vendor"))
            for k in [*stated.group("sets").split(", "), stated.group("last")]]
    for path in sorted(TOLERANCE.glob("*.json")):
        recorded = _artifact(path).get("kernel_sets")
        if sorted(recorded or []) != sorted(sets):  # the order they were measured in aside
            wrong.append(f"{path.name}: kernel sets {recorded}, the README says {sets}")
    # the random floors' figures per kernel set, on each vendor's CPU
    one = _artifact(TOLERANCE / "random_floor_1a.json")
    worst = {k: max(s["by_kernel_set"][k] for s in one["samples"]) for k in one["kernel_sets"]}
    wrong += compare(text, rf"On the AMD CPU, phase 1a's rule is the same under every set "
                           rf"\(worst floor {n('default')} under DEFAULT, {n('avx2')} under AVX2 "
                           rf"and AVX512\)", {"default": worst["AuthenticAMD/DEFAULT"],
                                              "avx2": worst["AuthenticAMD/AVX2"]})
    if worst["AuthenticAMD/AVX2"] != worst["AuthenticAMD/AVX512"]:
        wrong.append(f"phase 1a: AVX2's worst floor {worst['AuthenticAMD/AVX2']:.3g} is not "
                     f"AVX512's {worst['AuthenticAMD/AVX512']:.3g}, as the README says")
    wrong += compare(text, rf"on the Intel one the sets differ more \(worst floor "
                           rf"{n('default')} under DEFAULT, {n('avx2')} under AVX2, "
                           rf"{n('avx512')} under AVX512\)",
                     {"default": worst["GenuineIntel/DEFAULT"],
                      "avx2": worst["GenuineIntel/AVX2"], "avx512": worst["GenuineIntel/AVX512"]})
    two = _artifact(TOLERANCE / "random_floor_1b.json")
    wrong += compare(text, rf"its AVX2's give a worst floor of {n('avx2')}",
                     {"avx2": max(s["by_kernel_set"]["AuthenticAMD/AVX2"]
                                  for s in two["samples"])})
    return wrong


# --- the corpus: corpus/*.json origins ----------------------------------------------------

def corpus_mismatches(text: str) -> list[str]:
    origins = Counter(_artifact(p).get("origin", "seeded")
                      for p in (ROOT / "corpus").glob("*.json"))
    return compare(text, rf"{n('seeded')} of the corpus entries are "
                         rf"seeded\).*?; {n('discovered')} entries are "
                         r"discovered",
                   {"seeded": origins["seeded"], "discovered": origins["discovered"]})


# --- the fuzz campaigns: campaigns/*.json -------------------------------------------------

def moe_campaign_mismatches(text: str) -> list[str]:
    """The MoE routing figures: the validation's near ties and routing headroom, and the
    committed MoE campaign's examples, near ties and weakest kill."""
    v = _artifact(TOLERANCE / "random_floor_1a_moe.json")["validated"]
    wrong = compare(text, rf"met near ties in {n('refs')} of its {n('of')} references "
                          rf"\({n('choices')} of {n('all')} choices\) with {n('fp')} false "
                          rf"positives, the worst change of a selection score {n('room')}x",
                    {"refs": v["near_ties"]["references"], "of": v["references"],
                     "choices": v["near_ties"]["choices"], "all": v["near_ties"]["of"],
                     "fp": v["false_positives"], "room": v["min_route_headroom"]})
    name = "campaigns/2026-12-02-moe.json"
    if not (ROOT / name).is_file():
        return [*wrong, f"{name} is not committed"]
    s = _artifact(ROOT / name)
    kills = s["smallest_kill_ratios"]
    weakest = min(kills, key=kills.__getitem__)
    return wrong + compare(
        text, rf"`{re.escape(name)}` \(`wsb fuzz --moe --minutes {n('minutes')}`\): "
              rf"{n('examples')} examples over {n('props')} properties, {n('failures')} "
              rf"failures; {n('near')} examples had a choice within the bound "
              rf"\({n('choices')} of {n('all')} choices, the reference's kept there\) and "
              rf"{n('failed')} of them failed; the smallest kill ratio of an MoE mutation "
              rf"{n('kill')}x \(`(?P<weakest>\w+)`\)",
        {"minutes": s["campaign"]["budget"]["minutes"], "examples": s["totals"]["examples"],
         "props": s["totals"]["properties"], "failures": s["totals"]["failures"],
         "near": s["near_ties"]["examples"], "choices": s["near_ties"]["choices"],
         "all": s["near_ties"]["of_choices"], "failed": s["near_ties"]["failed"],
         "kill": kills[weakest], "weakest": weakest})


def campaign_mismatches(text: str) -> list[str]:
    cited = sorted(set(re.findall(r"campaigns/[\w.-]+\.json", text)))
    wrong = [f"the README cites {c}, which is not committed" for c in cited
             if not (ROOT / c).is_file()]
    if not cited:
        wrong.append("the README cites no campaign summary")
    name = "campaigns/2026-12-01-default.json"
    if not (ROOT / name).is_file():
        return [*wrong, f"{name} is not committed"]
    s = _artifact(ROOT / name)
    layout = {p["mutation"]: p["smallest_kill_ratio"] for p in s["properties"]
              if p["property"] == "kill" and p["smallest_kill_ratio"] is not None}
    weakest = min(layout, key=layout.__getitem__)
    pattern = (rf"`{re.escape(name)}`, the default `wsb fuzz --minutes "
               rf"{n('minutes')}`: {n('examples')} "
               rf"examples over {n('props')} properties in "
               rf"{n('seconds')} s, {n('failures')} "
               rf"failures \({n('new')} new corpus entries\), "
               rf"{n('faults')} harness faults, worst invariant ratio "
               rf"{n('worst')}, smallest kill ratio among the layout "
               rf"mutations {n('kill')}x \(`(?P<weakest>\w+)`\)")
    wrong += compare(text, pattern, {
        "minutes": s["campaign"]["budget"]["minutes"], "examples": s["totals"]["examples"],
        "props": s["totals"]["properties"], "seconds": s["campaign"]["duration_s"],
        "failures": s["totals"]["failures"], "new": len(s["totals"]["new_entries"]),
        "faults": s["totals"]["harness_faults"], "worst": s["worst_invariant_ratio"],
        "kill": layout[weakest], "weakest": weakest})
    # the discoveries the README names are this campaign's new entries, still in corpus/
    ratios: dict[str, list[float]] = {}
    for entry in s["totals"]["new_entries"]:
        path = ROOT / "corpus" / entry
        if not path.is_file():
            wrong.append(f"{name} created corpus/{entry}, which is not committed")
            continue
        data = _artifact(path)
        ratios.setdefault(data["case"]["mutation"], []).append(data["measured"]["ratio"])
    if set(ratios) != {"rope_permute_missing", "rope_permute_twice"}:
        return [*wrong, f"{name}'s discoveries are of {sorted(ratios)}, not the README's"]
    wrong += moe_campaign_mismatches(text)
    wrong += compare(text, rf"found `rope_permute_missing` and `rope_permute_twice` at "
                           rf"{n('both')}x .*? and `rope_permute_twice` at {n('twice')}x",
                     {"both": ratios["rope_permute_missing"][0],
                      "twice": min(ratios["rope_permute_twice"])})
    return wrong


CHECKS: dict[str, Callable[[str], list[str]]] = {
    "fuzz rules": fuzz_rule_mismatches, "mutation scores": mutation_mismatches,
    "floors": floor_mismatches, "corpus origins": corpus_mismatches,
    "campaign": campaign_mismatches}


@pytest.mark.parametrize("check", CHECKS, ids=str)
def test_the_readme_states_the_committed_figures(check):
    assert CHECKS[check](documentation()) == []


# --- twins: the same checks see a wrong figure ---------------------------------------------

def test_same_figure_rounds_to_the_digits_the_readme_shows():
    assert same_figure("162", 161.62) and same_figure("27.7", 27.6995)
    assert same_figure("1.19e-6", 1.1920928955078125e-06) and same_figure("1,011", 1011)
    assert same_figure("0.001", 0.001) and same_figure("20", 20)
    assert not same_figure("161", 161.62) and not same_figure("27.6", 27.6995)
    assert not same_figure("1.18e-6", 1.1920928955078125e-06) and not same_figure("1,012", 1011)
    assert not same_figure("2", 20)


@pytest.mark.parametrize("check, right, wrong", [
    ("fuzz rules", "held-out 100x over 507 samples", "held-out 61x over 507 samples"),
    ("fuzz rules", "Phase 1a: `relative`", "Phase 1a: `relative_pow10`"),
    ("fuzz rules", "keeps 162x held out but", "keeps 100x held out but"),
    ("mutation scores", "scored 99.0% (4153 killed", "scored 98.0% (4153 killed"),
    ("mutation scores", "comparison) 234 of 238 killed", "comparison) 233 of 238 killed"),
    ("floors", "(20 model and token seeds", "(10 model and token seeds"),
    ("floors", "worst 1.79e-6 and 1.73e-6", "worst 1.19e-6 and 1.09e-6"),
    ("floors", "under DEFAULT, AVX2 and AVX512 (their", "under AVX2 and AVX512 (their"),
    ("floors", "on AuthenticAMD and GenuineIntel CPUs", "on AuthenticAMD and AuthenticAMD CPUs"),
    ("floors", "1.1e-6 on the AMD EPYC", "1.7e-6 on the AMD EPYC"),
    ("floors", "2.29e-5 under DEFAULT", "2.2e-5 under DEFAULT"),
    ("floors", "1.09e-5 under DEFAULT", "2.29e-5 under DEFAULT"),
    ("floors", "worst floor of 1.07e-5", "worst floor of 7.51e-6"),
    ("campaign", "(1832 of 81455 choices, the", "(1831 of 81455 choices, the"),
    ("campaign", "ratio of an MoE mutation 17.3x (`qk_norm", "ratio of an MoE mutation 17.3x (`w13"),
    ("campaign", "in 162 of its 402 references", "in 161 of its 402 references"),
    ("corpus origins", "3 entries are discovered", "0 entries are discovered"),
    ("campaign", "9606 examples", "9660 examples"),
    ("campaign", "38.9x (`gate_up_swapped`)", "38.9x (`replica_scaled`)"),
    ("campaign", "at 0.00018x with 4 query heads", "at 0.0018x with 4 query heads"),
])
def test_a_readme_with_one_wrong_figure_is_caught(check, right, wrong):
    text = _flat(documentation())
    assert right in text, f"the twin's figure {right!r} is not in the README"
    assert _clean(check, text) == []
    found = CHECKS[check](text.replace(right, wrong, 1))
    assert found and all(isinstance(m, str) for m in found), found


@functools.lru_cache(maxsize=None)
def _clean(check: str, text: str) -> list[str]:
    """What ``check`` finds in the unchanged text: once a process, not once a twin."""
    return CHECKS[check](text)


def test_a_sentence_that_is_gone_is_caught():
    assert compare("nothing here", r"worst (?P<x>[0-9.]+)", {"x": 1.0}) == [
        "the README no longer states /worst (?P<x>[0-9.]+)/"]


def test_a_cited_campaign_that_is_not_committed_is_caught():
    text = documentation()
    assert campaign_mismatches(text) == []
    assert campaign_mismatches(text + "\nsee `campaigns/2026-13-01-missing.json`\n") == [
        "the README cites campaigns/2026-13-01-missing.json, which is not committed"]
