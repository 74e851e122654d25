"""The rank side of phase 1b (``check.forwards.phase1b_task``) at what the mutation pass over
``check/forwards.py`` found unread (issue 30): the reference only when asked, the routing
guard reaching every rank, and the forward's phase marked for the fault hook and a hang
report. ``test_forwards_gloo.py`` has the rest."""

from __future__ import annotations

import pytest
import torch

from tests.sync.conftest import MOE_FEW as MOE
from tests.sync.conftest import forced_guard
from weight_sync_bench.check.forwards import run_phase1b
from weight_sync_bench.collectives.gloo.breadcrumbs import Fault
from weight_sync_bench.collectives.gloo.pool import shared_pool
from weight_sync_bench.errors import RankFailure
from weight_sync_bench.model.config import init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel


def test_the_reference_is_computed_on_rank_0_only_when_asked():
    pool = shared_pool(4)
    plain = run_phase1b(MOE, 2, param_seed=1, token_seed=2, pool=pool)
    assert plain.reference is None
    asked = run_phase1b(MOE, 2, param_seed=1, token_seed=2, pool=pool, reference=True)
    expected = ReferenceModel(MOE, init_params(MOE, 1))(make_tokens(MOE, 2))
    assert torch.equal(asked.reference, expected)


def test_the_routing_guard_reaches_every_rank():
    """A guard that keeps every choice (bound infinite) and holds other choices than the
    reference's (every token on experts 0 and 1): the ranks follow it, so the logits move."""
    pool = shared_pool(4)
    plain = run_phase1b(MOE, 2, param_seed=1, token_seed=2, pool=pool)
    guided = run_phase1b(MOE, 2, param_seed=1, token_seed=2, pool=pool,
                         guard=forced_guard(MOE))
    assert not torch.equal(plain.logits, guided.logits)


def test_the_ranks_mark_the_forward_where_its_collectives_run():
    with pytest.raises(RankFailure, match=r"raise at rank 1, forward collective 1\n"):
        run_phase1b(MOE, 2, param_seed=0, token_seed=0, pool=shared_pool(4),
                    fault=Fault("raise", 1, phase="forward", index=1))


def test_each_rank_returns_what_its_sink_received_when_asked():
    from weight_sync_bench.layout.reshard import split
    from weight_sync_bench.model.plan import layout_for

    pool = shared_pool(4)
    got = run_phase1b(MOE, 2, param_seed=1, token_seed=2, pool=pool, return_shards=True)
    declared = split(init_params(MOE, 1), layout_for(MOE), 2)
    assert len(got.shards) == 2 and all(
        mine.keys() == want.keys() and all(torch.equal(mine[n], want[n]) for n in want)
        for mine, want in zip(got.shards, declared))
    assert run_phase1b(MOE, 2, param_seed=1, token_seed=2, pool=pool).shards is None


def test_a_conventions_forward_over_gloo_is_marked_where_its_collectives_run():
    from weight_sync_bench.check import forwards
    from weight_sync_bench.conventions import (
        endpoint,
        forward_inputs,
        materialize,
        reading_plan,
    )
    from weight_sync_bench.model.stepwise import computing

    where = endpoint("vllm:2")
    plan = reading_plan(where.convention, MOE, where)
    shards = materialize(where.pieces(MOE), init_params(MOE, 0))
    inputs = [computing(x) for x in forward_inputs(shards, where.convention, MOE, where)]
    kwargs = {"forward": plan.forward, "tokens": make_tokens(MOE, 0), "dtype": torch.float32,
              "guard": None}
    rank_kwargs = [{"inputs": inputs}, {"inputs": None}]
    with pytest.raises(RankFailure, match=r"raise at rank 1, forward collective 1\n"):
        shared_pool(4).run(forwards.conversion_forward_task, 2, kwargs=kwargs,
                           rank_kwargs=rank_kwargs,
                           fault=Fault("raise", 1, phase="forward", index=1))
    logits = shared_pool(4).run(forwards.conversion_forward_task, 2, kwargs=kwargs,
                                rank_kwargs=rank_kwargs)[0]
    assert torch.equal(logits, forwards.gloo_logits(plan.forward, inputs, kwargs["tokens"]))


@pytest.mark.parametrize("at", ["meta:2", "vllm:tp=2,ep=2"])
def test_a_conventions_forward_over_gloo_is_its_forward_in_process(at):
    """Meta's hidden-split embedding (a dense model's) and vLLM's experts over EP: each rank
    reads the forward layout's own placements; an MoE forward's routing guard reaches every
    rank (one holding other choices than the reference's moves the logits)."""
    from weight_sync_bench.check.floor import convention_logits
    from weight_sync_bench.conventions import endpoint, materialize

    config = MOE if "ep" in at else MOE.replace(name="dense_few", n_experts=0, top_k=0,
                                                expert_ffn=0)
    where, tokens = endpoint(at), make_tokens(config, 0)
    shards = materialize(where.pieces(config), init_params(config, 0))
    there = convention_logits(where, config, shards, tokens, phase="1b")
    assert torch.allclose(there, convention_logits(where, config, shards, tokens), atol=1e-5)
    if not config.n_experts:
        return
    assert not torch.equal(there, convention_logits(where, config, shards, tokens, phase="1b",
                                                    guard=forced_guard(config)))
