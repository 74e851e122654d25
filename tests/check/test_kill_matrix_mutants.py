"""The kill matrix's rows read exactly (issue 30's mutation testing of ``check/kill_matrix.py``),
with mutations made for the purpose: what each row says of a conversion where the mutation
does not apply, where it is declared the identity (truthfully, and not), where it changes a
parameter its ``changes`` does not name, and where it is live (killed at the margin, or a
change too small to reach it); how many rows a mutation gets (one verdict per key: per
destination, or per source and destination); and ``live=False``, which computes no forward.

A dense geometry and a fixed threshold: the rows are the matrix's logic, not a floor."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from weight_sync_bench.check.conversion import conversion_checker
from weight_sync_bench.check.kill_matrix import KILL_MARGIN, KillRow, kill_matrix
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.mutations import (
    ROUTER_BIAS,
    Conversion,
    ConversionMutation,
)
from weight_sync_bench.model.config import TOY

SMALL = TOY.replace(name="kill_rows", vocab=128, d_model=32, n_heads=4, n_kv_heads=2,
                    head_dim=8, ffn=48, n_layers=2, seq_len=8)
ENDPOINTS = [endpoint(e) for e in ("hf", "vllm:2", "megatron:2")]
THRESHOLD = 1e-4


@functools.cache
def _checker():
    return conversion_checker(SMALL, threshold=THRESHOLD)


HEAD = ("lm_head", "output_layer")  # the output head's stored names (HF and vLLM, Megatron)


def _scale(factor: float):
    """The output head times ``factor``, on every rank."""
    def bug(shards, conversion):
        return [{n: x * factor if n.startswith(HEAD) else x for n, x in rank.items()}
                for rank in shards]
    return bug


def _nudge(shards, conversion):
    """One element of rank 0's final norm moved by one ulp: bytes differ, the logits barely."""
    out = [dict(rank) for rank in shards]
    name = next(n for n in out[0] if n.endswith("norm.weight") and "layers" not in n)
    x = out[0][name].clone()
    x[0] = torch.nextafter(x[0], torch.tensor(2.0))
    out[0][name] = x
    return out


def _mutation(name, bug, *, applies=None, identity=None, changes=r".*", depends_on="destination"):
    return ConversionMutation(name, "a test's", "none", bug,
                              applies or (lambda c: "the same endpoint" if c.src == c.dst
                                          else None),
                              identity or (lambda c: None), changes, depends_on)


def _rows(mutation, **kw) -> list[KillRow]:
    return list(kill_matrix(_checker(), ENDPOINTS, [mutation], **kw))


def test_a_row_per_destination_after_the_pairs_it_does_not_apply_to():
    rows = _rows(_mutation("lm_head_x10", _scale(10.0)))
    skipped = [r for r in rows if r.outcome == "not applicable"]
    assert [(r.conversion.src, r.conversion.dst) for r in skipped] == [
        (e, e) for e in ENDPOINTS]
    assert all(r.reason == "the same endpoint" and r.verdict is None for r in skipped)
    live = [r for r in rows if r.outcome != "not applicable"]
    # one verdict per destination, from the first source that is not the destination
    hf, vllm, megatron = ENDPOINTS
    assert [(r.conversion.src, r.conversion.dst) for r in live] == [
        (hf, vllm), (hf, megatron), (vllm, hf)]
    for r in live:
        assert r.outcome == "killed" and r.ratio == r.verdict.ratio >= KILL_MARGIN
        assert not r.verdict.passed and r.mutation == "lm_head_x10" and r.reason is None
        assert r.verdict.mutation == "lm_head_x10"  # the verdict names what it judged
        assert r.conversion == Conversion(SMALL, r.conversion.src, r.conversion.dst)
        assert r.changed == ("lm_head.weight",) and r.stray == ()


def test_a_ratio_of_exactly_the_margin_is_a_kill():
    """The margin is inclusive: a threshold set so that the head's error is exactly
    ``KILL_MARGIN`` times it kills; a hair above that threshold does not."""
    (first, *_) = [r for r in _rows(_mutation("lm_head_x10", _scale(10.0)))
                   if r.outcome != "not applicable"]
    error = first.verdict.max_abs_error
    threshold = error / KILL_MARGIN
    assert error / threshold == KILL_MARGIN  # exactly, in floating point, for this error
    at, above = (list(kill_matrix(conversion_checker(SMALL, threshold=t), ENDPOINTS[:2],
                                  [_mutation("lm_head_x10", _scale(10.0))]))
                 for t in (threshold, math.nextafter(threshold, math.inf)))
    (at,) = [r for r in at if r.conversion == first.conversion]
    (above,) = [r for r in above if r.conversion == first.conversion]
    assert (at.ratio, at.outcome) == (KILL_MARGIN, "killed")
    assert above.ratio < KILL_MARGIN and above.outcome == "survived"


def test_a_key_with_the_source_in_it_gets_a_row_per_ordered_pair():
    rows = _rows(_mutation("lm_head_x10", _scale(10.0), depends_on="source degree"))
    live = [r for r in rows if r.outcome != "not applicable"]
    assert len(live) == len(ENDPOINTS) * (len(ENDPOINTS) - 1)


def test_a_change_below_the_margin_survives_and_says_so():
    (row, *_) = [r for r in _rows(_mutation("nudge", _nudge)) if r.outcome != "not applicable"]
    assert row.outcome == "survived" and row.changed == ("norm.weight",)
    assert not row.verdict.passed  # the bytes differ ...
    assert row.ratio < KILL_MARGIN  # ... and the forward barely moves


def test_an_identity_is_compared_byte_for_byte_and_a_false_one_shows_what_it_changed():
    honest = _mutation("noop", lambda shards, c: shards, identity=lambda c: "nothing to do")
    rows = [r for r in _rows(honest) if r.outcome != "not applicable"]
    assert {(r.outcome, r.reason, r.changed, r.stray, r.verdict) for r in rows} == {
        ("identity", "nothing to do", (), (), None)}
    # declared the identity, yet it changes the head, and its changes name only the norms
    liar = _mutation("liar", _scale(10.0), identity=lambda c: "claims nothing",
                     changes=r".*norm\.weight")
    rows = [r for r in _rows(liar) if r.outcome != "not applicable"]
    assert {(r.outcome, r.changed, r.stray) for r in rows} == {
        ("identity", ("lm_head.weight",), ("lm_head.weight",))}
    assert {(r.mutation, r.conversion.config, r.reason) for r in rows} == {
        ("liar", SMALL, "claims nothing")}


def test_a_changed_byte_is_a_change_even_where_the_value_is_equal():
    """Megatron pads the 128-row vocabulary to 256 at t=2: rank 1's output rows are zeros.
    Written as -0.0 they compare equal as values (``torch.equal``) and not as bytes: a
    declared identity that does this changed a byte, and its row says which parameter."""
    def sign(shards, conversion):
        if str(conversion.dst) != "megatron:2":
            return shards
        out = [dict(rank) for rank in shards]
        assert not out[1]["output_layer.weight"].any()
        out[1]["output_layer.weight"] = -out[1]["output_layer.weight"]
        return out

    rows = [r for r in _rows(_mutation("signed_zeros", sign, identity=lambda c: "zeros"))
            if r.outcome == "identity"]
    assert {(str(r.conversion.dst), r.changed) for r in rows} == {
        ("hf:1", ()), ("vllm:2", ()), ("megatron:2", ("lm_head.weight",))}


def test_a_change_its_changes_names_is_not_stray_and_one_it_does_not_is():
    named = _rows(_mutation("head", _scale(10.0), changes=r"lm_head\.weight"))
    stray = _rows(_mutation("head", _scale(10.0), changes=r"lm_head"))  # fullmatch
    assert {r.stray for r in named if r.outcome == "killed"} == {()}
    assert {r.stray for r in stray if r.outcome == "killed"} == {("lm_head.weight",)}


def test_without_live_a_live_row_computes_nothing_and_an_identity_still_compares():
    live = _mutation("lm_head_x10", _scale(10.0))
    rows = [r for r in _rows(live, live=False) if r.outcome != "not applicable"]
    assert len(rows) == 3 and all(
        (r.outcome, r.verdict, r.changed, r.stray, r.reason) == ("live", None, (), (), None)
        and (r.mutation, r.conversion.config) == ("lm_head_x10", SMALL) for r in rows)
    # an identity on the HF destination only: that row is compared, the others stay live
    liar = _mutation("liar", _scale(10.0),
                     identity=lambda c: "claims nothing" if c.dst.convention.name == "hf" else None)
    rows = [r for r in _rows(liar, live=False) if r.outcome != "not applicable"]
    assert {(r.outcome, r.conversion.dst.convention.name, r.changed) for r in rows} == {
        ("identity", "hf", ("lm_head.weight",)), ("live", "vllm", ()), ("live", "megatron", ())}
    assert all(r.mutation == "liar" and r.conversion.config == SMALL for r in rows)


MOE = SMALL.replace(name="kill_rows_moe", n_experts=4, top_k=2, expert_ffn=16, router="sigmoid",
                    router_bias=True)


def test_a_selection_bias_that_moves_no_choice_is_unchanged_with_its_verdict_kept():
    """DeepSeek-V3's correction bias only selects: the same shift on every expert's bias
    moves no token's choice, so the forward cannot see it (``check.routing``) and the row
    says so, with the byte verdict that did see it."""
    def shift(shards, conversion):
        return [{n: x + 0.25 if n.endswith("e_score_correction_bias") else x
                 for n, x in rank.items()} for rank in shards]

    check = conversion_checker(MOE, threshold=THRESHOLD)
    mutation = _mutation("bias_shift", shift, changes=ROUTER_BIAS)
    rows = [r for r in kill_matrix(check, ENDPOINTS[:2], [mutation])
            if r.outcome != "not applicable"]
    assert len(rows) == 2
    for r in rows:
        assert r.outcome == "unchanged" and "choice" in r.reason, r.reason
        assert (r.mutation, r.conversion.config, r.stray) == ("bias_shift", MOE, ())
        assert r.changed == ("layers.0.router.bias", "layers.1.router.bias")
        assert r.verdict is not None and not r.verdict.passed  # the bytes show it
        assert r.verdict.mutation == "bias_shift"
    # with a stray change the forward cannot see either: Megatron pads the 128-row
    # vocabulary to 256 at t=2, so rank 1's output rows are all padding, written as -0.0
    def shift_and_sign(shards, conversion):
        out = shift(shards, conversion)
        if str(conversion.dst) == "megatron:2":
            assert not out[1]["output_layer.weight"].any()  # zeros: padding only
            out[1] = {**out[1], "output_layer.weight": -out[1]["output_layer.weight"]}
        return out

    signed = _mutation("bias_shift_signed", shift_and_sign, changes=ROUTER_BIAS)
    (row,) = [r for r in kill_matrix(check, [endpoint("hf"), endpoint("megatron:2")], [signed])
              if r.outcome != "not applicable" and r.conversion.dst.convention.name != "hf"]
    assert row.outcome == "unchanged", row.outcome
    assert row.stray == ("lm_head.weight",)  # changed, and not among what its changes names
    # the twin: a shift of one expert's bias that moves choices is live, and killed
    def tilt(shards, conversion):
        return [{n: _tilted(x) if n.endswith("e_score_correction_bias") else x
                 for n, x in rank.items()} for rank in shards]

    tilted = [r for r in kill_matrix(check, ENDPOINTS[:2],
                                     [_mutation("bias_tilt", tilt, changes=ROUTER_BIAS)])
              if r.outcome != "not applicable"]
    assert {r.outcome for r in tilted} == {"killed"}


def _tilted(bias):
    out = bias.clone()
    out[0] += 100.0  # expert 0 chosen by every token
    return out


@pytest.mark.parametrize("factor", [1.0, 10.0])
def test_the_mutated_copy_leaves_the_checker_s_shards_alone(factor):
    """The twin of every row above: after a matrix, the declared shards are as declared."""
    before = [{n: x.clone() for n, x in rank.items()} for rank in _checker().declared("hf")]
    _rows(_mutation("x", _scale(factor)))
    after = _checker().declared("hf")
    assert all(torch.equal(a[n], b[n]) for a, b in zip(before, after) for n in a)
