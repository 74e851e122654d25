"""Phase 1b: one process per rank over gloo reproduces the reference at every degree.

The threshold is phase 1b's own, never phase 1a's (the seed explains why): read from
``tolerance/phase1b.json`` through ``threshold_for(config, "1b")``.
"""

from __future__ import annotations

import inspect
import marshal
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.breadth import breadth
from tests.check.narrow import narrowed
from weight_sync_bench.check import forwards as phase1b
from weight_sync_bench.check.checker import check_split
from weight_sync_bench.check.forwards import (
    FORWARD_MODULES,
    forward_fingerprint,
    gloo_forward,
    phase1b_logits,
    run_phase1b,
)
from weight_sync_bench.collectives.gloo.pool import is_alive, shared_pool
from weight_sync_bench.errors import InvalidShards, UnsupportedLayout
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model import reference, sharded
from weight_sync_bench.model.config import TOY, TOY_KV4, init_params, make_tokens
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.tolerance.rules import threshold_for

CELLS = [(config, t) for config in (TOY, TOY_KV4) for t in layout_for(config).supported_degrees()]
SEEDS = (0, 1)


def test_the_cells_are_every_degree_of_both_configs():
    assert [(c.name, t) for c, t in CELLS] == [
        ("toy", 1), ("toy", 2), ("toy_kv4", 1), ("toy_kv4", 2), ("toy_kv4", 4)]


# TOY at both its degrees and TOY_KV4 at 4 (its own phase 1b floor, each rank one KV head)
# by default; TOY_KV4 at 1 and 2 in the long run: their equivalents are TOY's t1 (a one-way
# split, deviation exactly 0) and t2 (KV heads split, none replicated).
@pytest.mark.parametrize(("config", "degree"), breadth(
    [pytest.param(c, t, id=f"{c.name}-t{t}") for c, t in CELLS],
    keep={"toy-t1", "toy-t2", "toy_kv4-t4"}, name=lambda p: p.id))
def test_phase1b_logits_match_the_reference_at_every_degree(config, degree):
    threshold = threshold_for(config, "1b")  # checks the recorded geometry and token shape
    for seed in SEEDS:
        result = run_phase1b(config, degree, param_seed=seed, token_seed=1000 + seed,
                             pool=shared_pool(4), reference=True)
        deviation = (result.logits - result.reference).abs().max().item()
        assert result.logits.shape == (config.batch, config.seq_len, config.vocab)
        assert deviation <= threshold, (config.name, degree, seed, deviation, threshold)
        if degree == 1:
            assert deviation == 0.0  # a one-way split reorders no sum


def test_an_unrepresentable_degree_is_rejected_before_any_rank_starts():
    # TOY has 2 KV heads: HeadPartitioned cannot split them 4 ways (no replication declared).
    with pytest.raises(UnsupportedLayout, match=r"n_kv_heads % t == 0 \(n_kv_heads=2, t=4\)"):
        run_phase1b(TOY, 4, param_seed=0, token_seed=0, pool=None)


def _reversed_o_proj(shards):
    """Break 2: o_proj sharded on dim 1 correctly but the rank-to-slice assignment reversed."""
    out = [dict(params) for params in shards]
    for name in shards[0]:
        if name.endswith("o_proj.weight"):
            for rank, params in enumerate(out):
                params[name] = shards[len(shards) - 1 - rank][name]
    return out


def test_a_layout_bug_over_gloo_exceeds_the_threshold_many_times():
    """The twin of the invariant test: the same check fails when the layout is wrong."""
    config = TOY
    shards = _reversed_o_proj(split(init_params(config, 0), layout_for(config), 2))
    result = run_phase1b(config, 2, param_seed=0, token_seed=1000, pool=shared_pool(4),
                         shards=shards, reference=True)
    assert (result.logits - result.reference).abs().max().item() > 100 * threshold_for(config, "1b")


def test_the_ranks_run_the_in_process_forward_and_every_block_it_calls(monkeypatch):
    """Not two copies kept in step: every rank ran the code phase 1a runs. The fingerprint
    covers every function and method of model.sharded and model.reference (ShardedModel's
    methods and the blocks they call); not torch, and not the collective (which differs)."""
    result = run_phase1b(TOY_KV4, 4, param_seed=0, token_seed=0, pool=shared_pool(4))
    assert result.forward_codes == (forward_fingerprint(),) * 4
    # Not vacuous: a block the forward calls, the same source compiled as a copy, changes it;
    # so does a copy of ShardedModel.forward itself.
    before = forward_fingerprint()
    for module, owner, name in [(reference, reference, "rms_norm"),
                                (sharded, ShardedModel, "forward")]:
        copy: dict = {}
        source = textwrap.dedent(inspect.getsource(getattr(owner, name)))
        exec(compile(source, f"<a copy of {name}>", "exec"), dict(vars(module)), copy)
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, copy[name])
            assert forward_fingerprint() != before, name
    assert forward_fingerprint() == before


@pytest.mark.parametrize("name", FORWARD_MODULES)
def test_the_fingerprint_of_a_module_is_the_same_compiled_or_read_from_a_pyc(name, monkeypatch):
    """A rank's forkserver may import the forward from the .pyc the parent just wrote (any
    Python that writes bytecode): the same code must give the same fingerprint either way.
    ``marshal.dumps`` did not (it flags an object by its reference count, and a code object
    read back from marshal holds its constants otherwise): model.reference's
    ``expert_hidden`` came out different. The twin, an edited copy giving another
    fingerprint, is the test above."""
    code = _compiled(name)
    forms = (code, marshal.loads(marshal.dumps(code)))  # as a .pyc is written, then read
    assert _fingerprint_of(name, forms[0], monkeypatch) == _fingerprint_of(name, forms[1],
                                                                           monkeypatch)


def test_a_constant_changed_in_place_changes_the_fingerprint(monkeypatch):
    """Not vacuous in the constants: the same file, lines and names, one literal changed
    (rope's ``1.0 / theta``), is another fingerprint."""
    name = "weight_sync_bench.model.reference"
    edited = _compiled(name, edit=("1.0 / theta", "2.0 / theta"))
    assert _fingerprint_of(name, edited, monkeypatch) != _fingerprint_of(
        name, _compiled(name), monkeypatch)


def _compiled(name, edit=None):
    path = sys.modules[name].__file__
    source = Path(path).read_text()
    if edit is not None:
        assert edit[0] in source
        source = source.replace(*edit)
    return compile(source, path, "exec")


def _fingerprint_of(name, code, monkeypatch):
    """``forward_fingerprint`` of module ``name`` run from ``code`` instead."""
    module = ModuleType(name)
    module.__file__ = sys.modules[name].__file__
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, name, module)
        exec(code, vars(module))  # noqa: S102 (the harness's own module, compiled)
        return forward_fingerprint((name,))


# TOY over a 512-word vocabulary where no floor is read (a fifth of the bytes to scatter)
NARROW = narrowed(TOY)


def test_a_split_fn_runs_on_rank_0_and_matches_the_declared_split():
    declared = run_phase1b(NARROW, 2, param_seed=3, token_seed=4, pool=shared_pool(4))
    theirs = run_phase1b(NARROW, 2, param_seed=3, token_seed=4, pool=shared_pool(4),
                         split_fn=_split_narrow)
    assert torch.equal(theirs.logits, declared.logits)


def _split_declared(full, degree):
    return split(full, layout_for(TOY), degree)


def _split_narrow(full, degree):
    return split(full, layout_for(NARROW), degree)


def test_a_split_fn_that_fails_on_rank_0_stops_every_rank_and_keeps_the_pool():
    pool = shared_pool(4)
    pool.start()
    pids = pool.pids
    with pytest.raises(InvalidShards, match="full params: missing lm_head.weight") as caught:
        run_phase1b(NARROW, 2, param_seed=0, token_seed=0, pool=pool,
                    split_fn=_split_missing_head)
    assert "raised on rank 0" in "".join(caught.value.__notes__)
    assert "_split_missing_head" in "".join(caught.value.__notes__)  # rank 0's traceback
    assert pool.pids == pids
    assert phase1b_logits(NARROW, 2, param_seed=0, token_seed=0, pool=pool).isfinite().all()


def _split_missing_head(full, degree):
    del full["lm_head.weight"]
    return split(full, layout_for(NARROW), degree)


def test_gloo_forward_is_a_checker_forward():
    """``gloo_forward()`` has ``check.Forward``'s signature: the caller's shards and tokens."""
    params = init_params(TOY_KV4, 5)
    tokens = make_tokens(TOY_KV4, 6)
    logits = gloo_forward(shared_pool(4))(TOY_KV4, split(params, layout_for(TOY_KV4), 4), tokens)
    with torch.no_grad():
        reference = ReferenceModel(TOY_KV4, params)(tokens)
    assert (logits - reference).abs().max().item() <= threshold_for(TOY_KV4, "1b")


def test_a_one_off_pool_leaves_no_rank_process(monkeypatch):
    """``pool=None``: ranks are started for the one check and gone after it (checked by the
    pids of the pool the check really started; ranks are the forkserver's children, not ours)."""
    started: list[tuple[int, ...]] = []

    class Recorded(phase1b.RankPool):
        def start(self, **kwargs):
            super().start(**kwargs)
            started.append(self.pids)

    monkeypatch.setattr(phase1b, "RankPool", Recorded)
    config = TOY.replace(name="tiny", vocab=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                         head_dim=8, ffn=48)
    logits = phase1b_logits(config, 2, param_seed=0, token_seed=0)
    assert logits.shape == (config.batch, config.seq_len, config.vocab)
    (pids,) = started
    assert len(pids) == 2 and not any(is_alive(pid) for pid in pids)


def _naive_qkv(full, degree):
    shards = split(full, layout_for(TOY), degree)
    for name in full:
        if name.endswith("qkv.weight"):
            for rank, chunk in enumerate(full[name].chunk(degree)):
                shards[rank][name] = chunk.clone()
    return shards


def test_check_split_over_gloo_passes_the_declared_split_and_diagnoses_a_naive_one():
    ok = check_split(_split_declared, TOY, 2, backend="gloo")
    assert ok.passed and ok.phase == "1b" and ok.threshold == threshold_for(TOY, "1b")
    bad = check_split(_naive_qkv, TOY, 2, backend="gloo")
    assert not bad.passed and bad.ratio > 100 and bad.phase == "1b"
    assert bad.diagnosis[0] == (
        "rank 0 layers.0.qkv.weight holds Q heads 0-5; declared Q heads 0-3, K head 0, V head 0")
