"""``wsb fuzz --splitter | --resharder | --converter module:function``: the user's function on
the fuzz runner, a counterexample reported as the user reads it (exit 1), a correct function
passing (exit 0), declined cases counted and a run that declines all of them checking
nothing (exit 2), the domain narrowed from the command line, and ``wsb replay`` re-running a
user function's entry and saying when its source changed."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from weight_sync_bench.cli import main


@pytest.fixture(autouse=True)
def _own_corpus(monkeypatch, tmp_path_factory):
    """Each test writes the user-function entries it finds into a corpus of its own, not the
    process's shared copy, which other test files replay (and count) entry by entry."""
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path_factory.mktemp("corpus")))


FUNCTIONS = Path(__file__).resolve().parents[1] / "fuzz" / "user_functions.py"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``user_functions`` copied beside the user, who runs ``wsb`` there; a corpus of their own."""
    shutil.copy(FUNCTIONS, tmp_path / "my_functions.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_functions", raising=False)  # this test's copy
    corpus = tmp_path / "corpus"
    monkeypatch.setenv("WSB_CORPUS_DIR", str(corpus))
    return tmp_path


# 60 examples where the count is the point (a correct function passes them, a narrowed domain
# never meets the bug, the rounds of the progress line); FEW where a run is about what it
# reports (each planted bug here is found within its first 20 examples at seed 1, and each
# pass twin runs the same 20 draws as the run that found its twin's bug), a third of the time
FEW = 20

# The shipped geometries run first in every fuzz of a user's function, each judged by a
# threshold measured for it (~0.5 s a run, more for a converter's conventions): they run here
# where they are the subject (a correct resharder passes them, a narrowed domain leaves the
# ones outside it out, a converter's fixed degrees hold there too); elsewhere NO_REAL leaves
# them out (tests/fuzz/test_user_properties.py checks them through the API)
NO_REAL = "--no-real-geometries"


def _fuzz(capsys, *args, examples=60):
    code = main(["fuzz", "--examples", str(examples), "--seed", "1", *args])
    return code, capsys.readouterr()


def test_a_planted_bug_is_reported_shrunk_with_the_geometry_and_the_rows_exit_1(user_module,
                                                                                capsys):
    code, out = _fuzz(capsys, NO_REAL, "--resharder", "my_functions:reshard_wrong_for_mha",
                      examples=FEW)
    assert code == 1
    text = out.out
    assert "FAIL invariant fails on your resharder my_functions:reshard_wrong_for_mha" in text
    assert ("geometry: vocab=16 d_model=8 n_layers=1 n_heads=2 n_kv_heads=2 head_dim=2 ffn=4 "
            "batch=1 seq_len=4 rope_theta=10000 norm_eps=1e-05") in text
    assert ("rank 0 layers.0.qkv.weight holds Q head 0, K head 1, Q head 1, V head 0, K head 0, "
            "V head 1") in text
    assert "> threshold" in text and "first failing example: the " in text
    (entry,) = (user_module / "corpus").glob("*.json")
    assert json.loads(entry.read_text())["user"]["function"] == \
        "my_functions:reshard_wrong_for_mha"
    # --json carries what the text says: the same counterexample (its corpus entry runs
    # first), its degrees and the diagnosis lines, each as the text wrote it
    code, out = _fuzz(capsys, NO_REAL, "--resharder", "my_functions:reshard_wrong_for_mha",
                      "--json", examples=FEW)
    records = [json.loads(line) for line in out.out.splitlines()]
    (failure,) = [r for r in records if r["kind"] == "counterexample"]
    assert code == 1 and failure["property"] == "invariant" and failure["error"] is None
    assert failure["conventions"] is None
    assert f"degrees: t={failure['src']} -> t={failure['dst']}; " in text
    assert failure["first_mismatch"] == "layers.0.qkv.weight"
    assert ("rank 0 layers.0.qkv.weight holds Q head 0, K head 1, Q head 1, V head 0, K head 0, "
            "V head 1; declared Q heads 0-1, K heads 0-1, V heads 0-1") in failure["diagnosis"][0]
    assert all(f"    {line}\n" in text for line in failure["diagnosis"])


def test_the_progress_line_and_the_summary_count_one_counterexample_once(user_module,
                                                                         capsys):
    """Found in the first round, then replayed first (from the corpus) in every later one:
    one counterexample, in the last progress line as in the summary (the progress line
    once said 10 where the summary said 1)."""
    code, out = _fuzz(capsys, NO_REAL, "--resharder", "my_functions:reshard_wrong_for_mha",
                      "--chunk", "10")
    assert code == 1
    progress = re.findall(r"(\d+) examples, (\d+) failures, ", out.err)
    assert len(progress) >= 2 and progress[-1][1] == "1", progress
    assert re.search(r" 1 failures, 0 harness faults", out.out), out.out


def test_without_wsb_corpus_dir_the_entry_lands_in_the_users_project_not_the_checkout(
        user_module, capsys, monkeypatch):
    """A user's run from their own directory keeps what it finds there (``wsb-corpus/``,
    ``.hypothesis/``): the harness's checkout is left as it was."""
    from weight_sync_bench.paths import checkout

    monkeypatch.delenv("WSB_CORPUS_DIR")
    monkeypatch.delenv("WSB_FUZZ_DIR", raising=False)
    before = sorted((checkout() / "corpus").iterdir())
    code, out = _fuzz(capsys, NO_REAL, "--resharder", "my_functions:reshard_wrong_for_mha",
                      examples=FEW)
    assert code == 1
    (entry,) = (user_module / "wsb-corpus").glob("*.json")
    assert f"corpus entry: {entry}" in out.out
    assert list((user_module / ".hypothesis" / "summaries").glob("fuzz-*.json"))
    assert sorted((checkout() / "corpus").iterdir()) == before
    # the next fuzz of the same function reads its entries from the same place
    code, out = _fuzz(capsys, NO_REAL, "--resharder", "my_functions:reshard_wrong_for_mha",
                      examples=FEW)
    assert code == 1 and f"corpus entry: {entry} (already there)" in out.out
    assert f"corpus: {user_module / 'wsb-corpus'} (0 new entries)" in out.out


def test_the_correct_resharder_passes_exit_0(user_module, capsys):
    code, out = _fuzz(capsys, "--resharder", "my_functions:reshard_correct")
    assert code == 0, out.out
    assert "0 failures" in out.out and "0 declined" in out.out
    assert "mistral_nemo t=8 -> t=2 PASS" in out.out  # the shipped geometries ran first


def test_a_splitter_and_a_converter_with_fixed_degrees(user_module, capsys):
    code, out = _fuzz(capsys, NO_REAL, "--splitter", "my_functions:split_head_dim_from_d_model",
                      examples=FEW)
    assert code == 1 and "degrees: split of the full model -> t=" in out.out
    code, out = _fuzz(capsys, "--converter", "my_functions:convert_megatron_to_vllm",
                      "--from", "megatron:2", "--to", "vllm", examples=FEW)
    assert code == 0, out.out
    assert "megatron:2 -> vllm:" in out.out


def test_declined_cases_are_counted_and_all_declined_checks_nothing_exit_2(user_module, capsys):
    code, out = _fuzz(capsys, NO_REAL, "--resharder", "my_functions:reshard_declines_odd_vocab")
    assert code == 0
    assert "declined (Unsupported: skipped, not passed)" in out.out
    assert "smallest declined: " in out.out and "only even vocabularies" in out.out
    code, out = _fuzz(capsys, "--resharder", "my_functions:reshard_declines_everything",
                      "--no-real-geometries")
    assert code == 2
    assert "0 cases checked" in out.out and "tried no example: nothing was checked" in out.out


def test_the_domain_is_narrowed_from_the_command_line(user_module, capsys):
    code, out = _fuzz(capsys, "--resharder", "my_functions:reshard_wrong_for_mha", "--gqa-only")
    assert code == 0, out.out  # wrong only for MHA: a GQA-only domain never meets the bug
    assert "domain: n_kv_heads 1..4, group 2..4" in out.out
    code, out = _fuzz(capsys, NO_REAL, "--resharder", "my_functions:reshard_correct",
                      "--kv-heads", "1-2", "--max-d-model", "16", "--domain", "n_layers=1")
    assert code == 0 and "n_kv_heads 1..2" in out.out and "d_model 8..16 step 8" in out.out
    assert "n_layers 1..1" in out.out


@pytest.mark.parametrize(("args", "message"), [
    # the fuzz domain's KV heads are 1-4: its floor samples cover nothing wider
    (["--resharder", "my_functions:reshard_correct", "--kv-heads", "1-8"],
     "n_kv_heads=1-8: the fuzz domain has n_kv_heads 1..4"),
    (["--converter", "my_functions:convert_megatron_to_vllm", "--from", "megatron"],
     "--converter needs --from CONVENTION[:T] and --to CONVENTION[:T]"),
    (["--resharder", "my_functions:reshard_correct", "--from", "megatron"],
     "--from / --to name a converter's conventions"),
    (["--from", "megatron"], "--from is for fuzzing your own function"),
    (["--splitter", "my_functions:split_correct", "--src", "2"],
     "--src has no meaning with --splitter"),
    (["--resharder", "my_functions:nowhere"], "my_functions has no callable 'nowhere'"),
])
def test_bad_options_are_refused_exit_2(user_module, capsys, args, message):
    code, out = _fuzz(capsys, *args)
    assert code == 2 and message in out.err, out.err


def test_a_function_with_the_wrong_signature_is_the_users_code_exit_4(user_module, capsys):
    (user_module / "bad.py").write_text("def one(shards):\n    return shards\n")
    code, out = _fuzz(capsys, "--resharder", "bad:one")
    assert code == 4 and "has the wrong signature" in out.err


def test_replay_reruns_a_user_entry_and_says_when_its_source_changed(user_module, capsys):
    assert _fuzz(capsys, NO_REAL, "--resharder", "my_functions:reshard_vocab_tiles_of_64",
                 examples=FEW)[0] == 1
    code = main(["replay"])
    out = capsys.readouterr()
    assert code == 1 and "still failing" in out.out
    assert "the resharder my_functions:reshard_vocab_tiles_of_64" in out.out
    assert "changed since" not in out.out
    source = user_module / "my_functions.py"
    source.write_text(source.read_text() + "\n# edited\n")
    assert main(["replay"]) == 1
    assert "changed since the entry was written (sha256 " in capsys.readouterr().out


def test_phase_1b_fuzzes_a_users_resharder_over_gloo_and_finds_the_planted_bug(user_module,
                                                                               capsys):
    code, out = _fuzz(capsys, "--phase", "1b", "--no-real-geometries",
                      "--resharder", "my_functions:reshard_wrong_for_mha", examples=FEW)
    assert code == 1 and "phase 1b" in out.out
    assert ("rank 0 layers.0.qkv.weight holds Q head 0, K head 1, Q head 1, V head 0, K head 0, "
            "V head 1") in out.out
    code, out = main(["fuzz", "--examples", "6", "--seed", "1", "--phase", "1b",
                      "--no-real-geometries", "--resharder", "my_functions:reshard_correct"]), \
        capsys.readouterr()
    assert code == 0 and "0 failures" in out.out


def test_a_converter_from_pipeline_stages_is_fuzzed_with_each_ranks_coordinates(user_module,
                                                                                capsys):
    # the converter reads source= and conventions.rank_coordinates to turn local layer
    # indices global: it passes; the twin publishing local indices is a coverage failure
    code, out = _fuzz(capsys, NO_REAL, "--converter",
                      "my_functions:convert_staged_megatron_to_hf",
                      "--from", "megatron:tp=2,pp=2", "--to", "hf", examples=FEW)
    assert code == 0, out.out
    code, out = _fuzz(capsys, NO_REAL, "--converter",
                      "my_functions:convert_staged_local_as_global",
                      "--from", "megatron:tp=2,pp=2", "--to", "hf", examples=FEW)
    assert code == 1
    assert "degrees: megatron:tp=2,pp=2 -> hf:1" in out.out
    assert "coverage: never written on rank 0: layer 1" in out.out
    # a split the fuzz domain's layer counts cannot make is refused, saying what to do
    code, out = _fuzz(capsys, "--converter", "my_functions:convert_staged_megatron_to_hf",
                      "--from", "megatron:tp=2,pp=2,vpp=2", "--to", "hf")
    assert code == 2 and "fuzz a split those layers allow" in out.err


def test_a_converter_named_by_its_convention_is_fuzzed_over_pipeline_stages_too(user_module,
                                                                              capsys):
    # `--from megatron` and a converter taking source=: Megatron's pipeline splits are drawn
    # beside its TP degrees, so the local-index bug is found without naming a split; the
    # correct converter (the twin) passes every draw
    code, out = _fuzz(capsys, NO_REAL, "--converter",
                      "my_functions:convert_staged_local_as_global",
                      "--from", "megatron", "--to", "hf", examples=FEW)
    assert code == 1, out.out
    assert re.search(r"degrees: megatron:tp=\d+,pp=\d+\S* -> hf:1", out.out), out.out
    assert "coverage: never written on rank 0: layer" in out.out
    # the saved staged case is this converter's (named by its convention alone): the next
    # run replays it first, so even one example fails again
    assert main(["fuzz", "--examples", "1", "--seed", "2", "--no-real-geometries",
                 "--converter", "my_functions:convert_staged_local_as_global",
                 "--from", "megatron", "--to", "hf"]) == 1
    assert re.search(r"degrees: megatron:tp=\d+,pp=", capsys.readouterr().out)
    code, out = _fuzz(capsys, NO_REAL, "--converter",
                      "my_functions:convert_staged_megatron_to_hf",
                      "--from", "megatron", "--to", "hf", examples=FEW)
    assert code == 0, out.out
