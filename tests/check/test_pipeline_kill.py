"""The kill matrix of the pipeline-stage mutations (``conventions.mutations.PIPELINE_MUTATIONS``):
each stage bug of the field injected into the harness's own conversion is killed at
>= KILL_MARGIN x the threshold wherever it applies and is not the identity, over every
ordered pair of a set of endpoints that reaches every branch of the stage assignment (even,
interleaved, uneven last stage, the embedding and loss counted, with TP and with EP); a
declared identity leaves every byte alone, and each changes only what it says it changes.
The clean twin: the unmutated conversion over the same pairs passes."""

from __future__ import annotations

import functools

import pytest

from weight_sync_bench.check.convert import conversion_checker, measure_threshold
from weight_sync_bench.check.kill_matrix import KILL_MARGIN, kill_matrix
from weight_sync_bench.conventions import convert, endpoint
from weight_sync_bench.conventions.mutations import PIPELINE_MUTATIONS
from weight_sync_bench.model.config import TOY

# A vocabulary no multiple of 128 x 2 (Megatron's padding moves rows at TP 2), 4 layers.
PIPE = TOY.replace(name="pipe", vocab=250, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                   ffn=96, n_layers=4, seq_len=16)
PIPE_MOE = PIPE.replace(name="pipe_moe", n_experts=4, top_k=2, expert_ffn=32, qk_norm=True)
DENSE = ["hf", "vllm:2", "megatron:2", "megatron:tp=2,pp=2", "megatron:tp=1,pp=2,vpp=2",
         "megatron:tp=2,pp=2,pp_last=3", "megatron:tp=1,pp=2,pp_account=both",
         "megatron:tp=2,pp=2,vocab=unpadded"]
MOE = ["hf", "megatron:tp=2,pp=2,ep=2", "megatron:tp=1,pp=2,vpp=2,ep=2,etp=1"]


@functools.cache
def checker(config, endpoints):
    return conversion_checker(config, threshold=measure_threshold(config, endpoints))


@pytest.mark.parametrize(("config", "endpoints"), [(PIPE, DENSE), (PIPE_MOE, MOE)],
                         ids=["dense", "moe"])
def test_every_stage_mutation_is_killed_where_it_is_live(config, endpoints):
    rows = kill_matrix(checker(config, tuple(endpoints)), [endpoint(e) for e in endpoints],
                       PIPELINE_MUTATIONS)
    outcomes: dict[str, set[str]] = {}
    for row in rows:
        outcomes.setdefault(row.mutation, set()).add(row.outcome)
        if row.outcome == "not applicable":
            continue
        assert not row.stray, (row.mutation, str(row.conversion), row.stray)
        if row.outcome == "identity":
            assert not row.changed, (row.mutation, str(row.conversion), row.reason)
            continue
        assert row.outcome == "killed", str(row.verdict)
        assert row.ratio >= KILL_MARGIN
    if config is PIPE:  # every mutation is live somewhere in the dense matrix
        assert all("killed" in seen for seen in outcomes.values()), outcomes
        assert set(outcomes) == {m.name for m in PIPELINE_MUTATIONS}
    else:
        assert "killed" in outcomes["pp_local_layer_as_global"]
        assert "killed" in outcomes["pp_chunks_contiguous"]


@pytest.mark.parametrize(("config", "endpoints"), [(PIPE, DENSE), (PIPE_MOE, MOE)],
                         ids=["dense", "moe"])
def test_the_unmutated_conversions_pass(config, endpoints):
    check = checker(config, tuple(endpoints))
    for src in endpoints:
        for dst in endpoints:
            if src == dst:
                continue
            shards = convert(check.source(src), src, dst, config)
            verdict = check.verdict(shards, src=src, dst=dst)
            assert verdict.passed, verdict
