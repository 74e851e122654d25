"""One diagnosis, in the convention's words (``check.diagnosis``): the words of each kind of
canonical parameter (heads and KV heads of the fused qkv, gate and up halves, vocabulary
rows and padding, rows or columns of the rest), and the same planted bug told the same way
by ``check_split``, ``check_convert``, ``wsb verify`` and ``wsb sync``."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench import TOY_KV4, ModelConfig, layout_for, split
from weight_sync_bench.check import diagnosis
from weight_sync_bench.check.checker import check_split
from weight_sync_bench.check.convert import check_convert, verify_checkpoint
from weight_sync_bench.check.diagnosis import PADDING, ZEROS, describe, diagnose
from weight_sync_bench.cli.main import main
from weight_sync_bench.conventions import convert, endpoint, shards_for
from weight_sync_bench.conventions.checkpoint import write_checkpoint
from weight_sync_bench.conventions.maps import Piece, rows

G2 = ModelConfig(name="g2", vocab=64, d_model=16, n_layers=1, n_heads=8, n_kv_heads=2,
                 head_dim=4, ffn=12)  # Q rows 0-31, K rows 32-39, V rows 40-47


def words(source, indices, config=G2, dim=0):
    return describe(indices, Piece(source, dim, rows(0, 1)), config)


@pytest.mark.parametrize("indices, text", [
    (list(range(0, 16)) + list(range(32, 36)) + list(range(40, 44)),
     "Q heads 0-3, K head 0, V head 0"),
    ([*range(4, 8), *range(0, 4)], "Q head 1, Q head 0"),  # whole heads, out of order
    ([0, 2, 1, 3], "Q head 0 in pair order"),  # Meta's interleaved-pair rows of one head
    ([None, 1, 2, 3, *range(4, 8)], "?, Q head 0 rows 1-3, Q head 1"),  # a slice found nowhere
    ([*range(36, 40), ZEROS, ZEROS], "K head 1, zeros x2"),
    ([*range(30, 34)], "Q head 7 rows 2-3, K head 0 rows 0-1"),  # a cut across two heads
])
def test_the_fused_qkv_is_told_in_heads(indices, text):
    assert words("layers.0.qkv.weight", indices) == text
    assert words("layers.0.qkv.bias", indices) == text  # the bias's rows are the same heads


def test_gate_up_is_told_in_halves_and_the_vocabulary_in_token_rows_and_padding():
    assert words("layers.0.gate_up.weight", [*range(12, 18), *range(0, 6)]) == \
        "up rows 0-5, gate rows 0-5"
    for table in ("tok_embeddings.weight", "lm_head.weight"):
        assert words(table, [*range(60, 64), PADDING, PADDING]) == \
            "vocabulary rows 60-63, padding x2"
    # split on the hidden dimension (Meta's embedding), a table's columns are columns
    assert words("tok_embeddings.weight", [0, 1], dim=1) == "columns 0-1"
    assert words("layers.0.o_proj.weight", [3, 2], dim=1) == "columns 3, 2"
    assert words("norm.weight", [0, None]) == "elements 0, ?"


def test_a_kind_of_parameter_gets_its_words_from_one_table(monkeypatch):
    """The vocabulary is a table keyed by what the canonical parameter is (the same for
    every layer) and the dim: a kind added to it is told in its words, the rest unchanged."""
    monkeypatch.setitem(diagnosis.VOCABULARY, ("down.weight", 1),
                        lambda indices, config: f"hidden units {indices[0]}..")
    assert words("layers.0.down.weight", [5, 6], dim=1) == "hidden units 5.."
    assert words("layers.0.down.weight", [5, 6], dim=0) == "rows 5-6"
    assert words("layers.0.o_proj.weight", [5, 6], dim=1) == "columns 5-6"


def test_zeros_where_the_declared_piece_pads_are_its_padding_elsewhere_zeros():
    full = torch.arange(1, 9, dtype=torch.float32).reshape(8, 1).repeat(1, 3)
    piece = Piece("lm_head.weight", 0, torch.tensor([6, 7, -1, -1]))  # two rows, two of padding
    config = G2.replace(vocab=8)
    right = piece.take(full)
    assert diagnose({"lm_head.weight": full}, config, "out", [piece], [right]) == []
    wrong = torch.zeros_like(right)
    wrong[2:] = full[6:]  # the rows after the padding, zeros where they belong
    assert diagnose({"lm_head.weight": full}, config, "out", [piece], [wrong]) == [
        "rank 0 out holds zeros x2, vocabulary rows 6-7; declared vocabulary rows 6-7, "
        "padding x2"]


# ---- the same planted bug, four ways in

SWAPPED = "layers.0.gate_up.weight"


def _swap_rank0_halves(shards):
    """Rank 0's layer-0 gate_up stored up first, [up_0 | gate_0]: what the planner mutation
    ``gate_up_swapped`` makes of a plain destination."""
    w = shards[0][SWAPPED]
    shards[0][SWAPPED] = torch.cat(list(reversed(w.chunk(2))))
    return shards


@pytest.fixture(scope="module")
def expected():
    ffn = TOY_KV4.ffn // 2  # each rank's half of each half
    return (f"rank 0 {SWAPPED} holds up rows 0-{ffn - 1}, gate rows 0-{ffn - 1}; declared "
            f"gate rows 0-{ffn - 1}, up rows 0-{ffn - 1}",)


def test_check_split_and_check_convert_tell_the_planted_bug_the_same_way(expected):
    def splitter(full, degree):
        return _swap_rank0_halves(split(full, layout_for(TOY_KV4), degree))

    def converter(shards, degree):
        return _swap_rank0_halves(convert(shards, "megatron:4", f"plain:{degree}", TOY_KV4))

    by_split = check_split(splitter, TOY_KV4, 2)
    by_convert = check_convert(converter, TOY_KV4, "megatron:4", "plain:2")
    assert by_split.first_mismatch == by_convert.first_mismatch == SWAPPED
    assert by_split.diagnosis == by_convert.diagnosis == expected
    assert by_split.named_mutation is by_convert.named_mutation is None  # one rank, one layer


def test_wsb_verify_tells_it_the_same_way(expected, tmp_path, capsys):
    shards = _swap_rank0_halves(shards_for(TOY_KV4, "plain", 2))
    write_checkpoint(tmp_path / "ckpt", shards, endpoint("plain:2"), TOY_KV4)
    verdict = verify_checkpoint(tmp_path / "ckpt", TOY_KV4, "plain:2", src="megatron:4")
    assert verdict.diagnosis == expected
    assert main(["verify", str(tmp_path / "ckpt"), "--convention", "plain:2", "--config",
                 "toy_kv4", "--from", "megatron:4"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.strip() for line in out if line.strip().startswith("rank ")] == list(expected)


def test_wsb_sync_tells_it_the_same_way_from_the_one_regenerated_parameter(expected, capsys):
    """Phase 2's element check compares every element on the ranks, then diagnoses the first
    tensor that differs from its canonical parameter, regenerated (the generator's values,
    not ``init_params``': the indices, and so the line, are the same)."""
    assert main(["sync", "--config", "toy_kv4", "--from", "megatron:4", "--to", "plain:2",
                 "--mutation", "gate_up_swapped", "--no-forward"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.strip() for line in out if line.strip().startswith("rank ")
            and " holds " in line] == list(expected)

