"""The kill matrix of the conversion mutations: each public bug injected into a correct
converter's output is detected wherever it is not the identity, by >= KILL_MARGIN x the
threshold, for every pair of conventions and degrees of every geometry; where it is declared
the identity, its bytes really are unchanged (and the check passes).

The default run takes the matrix on TOY and the reduced llama3_8b, qwen2_5_7b and
mistral_nemo, but for the cells ``NIGHTLY_CELLS`` names (TOY's costliest: its 32000-row
vocabulary makes each 0.2-5 s; the costlier cells of llama3_8b and mistral_nemo whose every
outcome another default geometry's cell of the same mutation reaches); TOY_KV4 and the
reduced mistral_7b (llama3_8b's shapes under another rope_theta) join it in the long run
(``WSB_PROFILE=wsb-nightly``, ``make nightly``): every
outcome the long run's cells reach (each not-applicable reason, each identity reason, a live
kill) is one the default cells of the same mutation reach too, which
``test_the_default_geometries_reach_every_outcome_of_the_whole_matrix`` checks."""

from __future__ import annotations

import re

import pytest
import torch

from weight_sync_bench import TOY, TOY_KV4, ModelConfig
from weight_sync_bench.check.mutations import KILL_MARGIN
from weight_sync_bench.conventions import CONVENTIONS, convert, endpoint, shards_for
from weight_sync_bench.conventions.meta import permute
from weight_sync_bench.conventions.mutations import (
    DENSE_MUTATIONS,
    MOE_MUTATIONS,
    MUTATIONS,
    PIPELINE_MUTATIONS,
    Conversion,
    mutation_by_name,
)
from weight_sync_bench.errors import UnknownMutation
from weight_sync_bench.fuzz.profiles import profile_name
from weight_sync_bench.model.config import HF_CONFIGS, shipped_hf_config

MAX_DEGREE = 16
GEOMETRIES = [TOY, TOY_KV4, *(shipped_hf_config(n, shrink=16, n_layers=1, vocab=512)
                              for n in HF_CONFIGS)]
SMALL = ModelConfig(name="small", vocab=64, d_model=32, n_layers=1, n_heads=8, n_kv_heads=2,
                    head_dim=8, ffn=48)
# The long run's geometries (the module docstring): the branches each takes, the default
# ones take (test_the_default_geometries_reach_every_outcome_of_the_whole_matrix).
NIGHTLY_GEOMETRIES = ("toy_kv4", "mistral_7b")
NIGHTLY = pytest.mark.skipif(profile_name() != "wsb-nightly",
                             reason="the long run: WSB_PROFILE=wsb-nightly (make nightly)")
# The default geometries' cells the long run takes, each mutation keeping by default a
# cell that meets its every outcome (a kill, each identity and not-applicable reason): TOY's
# four costliest (its 32000-row vocabulary makes each 2-5 s) and its RoPE, qkv-order and
# vocab-split ones (0.2-0.8 s each; their kills the reduced llama3_8b and qwen2_5_7b cells
# keep, TOY's committed floor kv_replica_modulo keeps); of the 1/16-width llama3_8b and
# mistral_nemo, the ~1 s cells whose equivalent another default geometry keeps
# (megatron_fc1_rank_concat: qwen2_5_7b's; output_stale_copy and tp_rank_defaults_to_0:
# qwen2_5_7b's; embedding_joined_on_vocab: llama3_8b's; megatron_qkv_read_as_plain: llama3_8b's
# and qwen2_5_7b's; RoPE: llama3_8b's, mistral_nemo's head_dim off d / h keeping
# rope_permute_missing; kv_replica_modulo: llama3_8b's, the same 8 KV heads, whose identity
# reasons at t = 1-8 and kill at t = 16 are mistral_nemo's).
# test_the_default_geometries_reach_every_outcome_of_the_whole_matrix checks the default
# cells still reach every outcome.
NIGHTLY_CELLS = {*((g, m.name) for g in NIGHTLY_GEOMETRIES for m in DENSE_MUTATIONS),
                 *(("toy", m) for m in ("embedding_joined_on_vocab", "output_stale_copy",
                                        "megatron_fc1_rank_concat", "tp_rank_defaults_to_0",
                                        "rope_permute_missing", "rope_permute_twice",
                                        "rope_k_permuted_with_n_heads",
                                        "megatron_qkv_read_as_plain",
                                        "plain_qkv_read_as_megatron", "embedding_split_on_vocab")),
                 *(("llama3_8b", m) for m in ("megatron_fc1_rank_concat", "output_stale_copy",
                                              "tp_rank_defaults_to_0")),
                 *(("mistral_nemo", m) for m in ("megatron_fc1_rank_concat", "kv_replica_modulo",
                                                 "embedding_joined_on_vocab",
                                                 "output_stale_copy", "tp_rank_defaults_to_0",
                                                 "megatron_qkv_read_as_plain",
                                                 "rope_permute_twice",
                                                 "rope_k_permuted_with_n_heads"))}
MATRIX = [pytest.param(c, m, id=f"{c.name}-{m.name}",
                       marks=NIGHTLY if (c.name, m.name) in NIGHTLY_CELLS else ())
          for c in GEOMETRIES for m in DENSE_MUTATIONS]


def _bytes_equal(a, b):
    return all(torch.equal(x[n], y[n]) for x, y in zip(a, b) for n in x)


def endpoints(config):
    return [endpoint(f"{n}:{t}") for n, c in CONVENTIONS.items()
            for t in c.supported_degrees(config, MAX_DEGREE)]


# The dense geometries' matrix: the MoE mutations apply to no dense conversion (their matrix
# is tests/conventions/test_moe_conventions.py and tests/check/test_moe_kill.py).
@pytest.mark.parametrize(("config", "mutation"), MATRIX)
def test_every_mutation_is_killed_wherever_it_is_not_the_identity(config, mutation,
                                                                   checker_for_config):
    checker = checker_for_config(config)
    seen, killed = set(), 0
    for src in endpoints(config):
        for dst in endpoints(config):
            conversion = Conversion(config, src, dst)
            if mutation.not_applicable(conversion) or mutation.key(conversion) in seen:
                continue
            seen.add(mutation.key(conversion))
            declared = checker.declared(dst)
            mutated = mutation.apply(declared, conversion)
            if mutation.identity_reason(conversion) is not None:
                # a declared identity is one: not a byte moves (so the verdict is the pass
                # test_conversions shows for this destination)
                assert _bytes_equal(mutated, declared), (str(conversion),
                                                         mutation.identity_reason(conversion))
                continue
            # only what it says it changes (``changes``: check.naming applies it to no other)
            sources = {n: piece.source for rank in dst.pieces(config) for n, piece in rank.items()}
            changed = {n for new, old in zip(mutated, declared) for n in new
                       if not torch.equal(new[n], old[n])}
            assert changed and all(re.fullmatch(mutation.changes, sources[n]) for n in changed)
            # the twin of this detection is test_conversions: the same destination, unmutated,
            # passes the same check
            verdict = checker.verdict(mutated, src=src, dst=dst, mutation=mutation.name)
            assert not verdict.passed and verdict.first_mismatch is not None
            assert verdict.ratio >= KILL_MARGIN, str(verdict)
            killed += 1
    # Non-vacuous: each mutation is killed somewhere in every geometry that can hold it.
    meta = CONVENTIONS["meta"].supports(config, 1)
    expected = {
        "qkv_bias_not_split": config.has_qkv_bias,
        "kv_replica_modulo": any(t > config.n_kv_heads > 1 for t in
                                 CONVENTIONS["vllm"].supported_degrees(config, MAX_DEGREE)),
        "output_stale_copy": not config.tie_embeddings,
    }.get(mutation.name, meta if mutation.name.startswith(("rope_", "embedding_")) else True)
    assert (killed > 0) == expected, killed


def _outcomes(mutation, config):
    """What ``mutation`` meets over ``config``'s matrix: each reason it does not apply, each
    reason it is the identity, and ``"killed"`` where it is live (the branches of the test
    above)."""
    seen = set()
    for src in endpoints(config):
        for dst in endpoints(config):
            conversion = Conversion(config, src, dst)
            reason = mutation.not_applicable(conversion)
            if reason is not None:
                seen.add(("not applicable", reason))
                continue
            reason = mutation.identity_reason(conversion)
            seen.add(("identity", reason) if reason is not None else ("killed", None))
    return seen


def test_the_default_geometries_reach_every_outcome_of_the_whole_matrix():
    """The cells the default run leaves to the long run add no outcome of their own: whatever
    a mutation meets on them, it meets on a default geometry too."""
    names = {c.name for c in GEOMETRIES}
    assert {g for g, _ in NIGHTLY_CELLS} <= names and len(MATRIX) > len(NIGHTLY_CELLS)
    for mutation in DENSE_MUTATIONS:
        default = [c for c in GEOMETRIES if (c.name, mutation.name) not in NIGHTLY_CELLS]
        everywhere = set().union(*(_outcomes(mutation, c) for c in GEOMETRIES))
        by_default = set().union(*(_outcomes(mutation, c) for c in default))
        assert everywhere == by_default, (mutation.name, everywhere - by_default)
        assert ("killed", None) in by_default, mutation.name


def test_a_mutated_shard_set_depends_only_on_what_its_key_names():
    # tp_rank_defaults_to_0 depends on the destination only; megatron_fc1_rank_concat on
    # the source degree too: equal keys give equal bytes, different keys different bytes.
    declared = shards_for(SMALL, "vllm", 2)
    rank0 = mutation_by_name("tp_rank_defaults_to_0")
    a = rank0.apply(declared, Conversion(SMALL, endpoint("meta:2"), endpoint("vllm:2")))
    b = rank0.apply(declared, Conversion(SMALL, endpoint("hf"), endpoint("vllm:2")))
    assert _bytes_equal(a, b)
    fc1 = mutation_by_name("megatron_fc1_rank_concat")
    c2 = fc1.apply(declared, Conversion(SMALL, endpoint("megatron:2"), endpoint("vllm:2")))
    c1 = fc1.apply(declared, Conversion(SMALL, endpoint("megatron:1"), endpoint("vllm:2")))
    assert _bytes_equal(c1, declared) and not _bytes_equal(c2, declared)


def _literal_meta_to_hf(config, wk_heads, q_twice=False, skip=False):
    """convert_llama_weights_to_hf.py's write_model for one layer, with its bugs: permute
    k with ``wk_heads`` heads, permute q twice, or skip the permute."""
    meta = shards_for(config, "meta", 1)[0]
    hf = shards_for(config, "hf", 1)[0]
    for i in range(config.n_layers):
        wq, wk = meta[f"layers.{i}.attention.wq.weight"], meta[f"layers.{i}.attention.wk.weight"]
        q = wq if skip else permute(wq, config.n_heads)
        q = permute(q, config.n_heads) if q_twice else q
        k = wk if skip else permute(wk, wk_heads)
        k = permute(k, wk_heads) if q_twice else k
        hf[f"model.layers.{i}.self_attn.q_proj.weight"] = q
        hf[f"model.layers.{i}.self_attn.k_proj.weight"] = k
    return [hf]


@pytest.mark.parametrize("name, literal", [
    ("rope_permute_missing", lambda c: _literal_meta_to_hf(c, c.n_kv_heads, skip=True)),
    ("rope_permute_twice", lambda c: _literal_meta_to_hf(c, c.n_kv_heads, q_twice=True)),
    ("rope_k_permuted_with_n_heads", lambda c: _literal_meta_to_hf(c, c.n_heads)),
])
def test_each_rope_mutation_is_the_literal_bug_of_hfs_conversion_script(name, literal):
    # The HF permute (convert_llama_weights_to_hf.py), applied as the bug applies it, gives
    # exactly the bytes the mutation gives; the correct script gives the declared HF shards.
    conversion = Conversion(SMALL, endpoint("meta"), endpoint("hf"))
    declared = shards_for(SMALL, "hf", 1)
    assert _bytes_equal(_literal_meta_to_hf(SMALL, SMALL.n_kv_heads), declared)
    assert _bytes_equal(mutation_by_name(name).apply(declared, conversion), literal(SMALL))


def test_the_to_meta_rope_mutations_store_the_rows_the_buggy_inverse_writes():
    # gpt-fast's inverse (HF -> Meta): w.view(n, 2, hd // 2, d).transpose(1, 2).reshape
    def unpermute(w, n):
        return w.view(n, 2, w.shape[0] // n // 2, -1).transpose(1, 2).reshape(w.shape)
    hf = shards_for(SMALL, "hf", 1)[0]
    declared = shards_for(SMALL, "meta", 1)
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(declared[0]["layers.0.attention.wq.weight"], unpermute(q, SMALL.n_heads))
    conversion = Conversion(SMALL, endpoint("hf"), endpoint("meta"))
    wrong_k = mutation_by_name("rope_k_permuted_with_n_heads").apply(declared, conversion)
    assert torch.equal(wrong_k[0]["layers.0.attention.wk.weight"], unpermute(k, SMALL.n_heads))
    missing = mutation_by_name("rope_permute_missing").apply(declared, conversion)
    assert torch.equal(missing[0]["layers.0.attention.wq.weight"], q)


def test_fc1_rank_concat_is_megatrons_shards_concatenated_then_halved():
    source = shards_for(SMALL, "megatron", 2)
    fc1 = torch.cat([s["decoder.layers.0.mlp.linear_fc1.weight"] for s in source])
    gate, up = fc1.chunk(2)  # [g0 u0 | g1 u1] read as [gate | up]
    conversion = Conversion(SMALL, endpoint("megatron:2"), endpoint("hf"))
    mutated = mutation_by_name("megatron_fc1_rank_concat").apply(
        convert(source, "megatron", "hf", SMALL), conversion)[0]
    assert torch.equal(mutated["model.layers.0.mlp.gate_proj.weight"], gate)
    assert torch.equal(mutated["model.layers.0.mlp.up_proj.weight"], up)


def test_kv_replica_modulo_gives_rank_r_kv_head_r_mod_n_kv():
    config = SMALL  # 2 KV heads at t=4: declared heads 0, 0, 1, 1; the bug 0, 1, 0, 1
    conversion = Conversion(config, endpoint("hf"), endpoint("vllm:4"))
    declared = shards_for(config, "vllm", 4)
    mutated = mutation_by_name("kv_replica_modulo").apply(declared, conversion)
    hd, q_local = config.head_dim, config.q_rows // 4
    name = "model.layers.0.self_attn.qkv_proj.weight"
    k = [m[name][q_local:q_local + hd] for m in mutated]
    assert torch.equal(k[1], declared[2][name][q_local:q_local + hd])  # rank 1 holds head 1
    assert torch.equal(k[2], declared[0][name][q_local:q_local + hd])  # rank 2 holds head 0


@pytest.mark.parametrize("name, conversion, reason", [
    # t=1: one rank, nothing to copy from rank 0
    ("tp_rank_defaults_to_0", ("hf", "vllm:1"), "t=1: a single rank holds every tensor"),
    # t=2 <= 2 KV heads: nothing replicated, no replica to pick wrongly
    ("kv_replica_modulo", ("hf", "vllm:2"), "t=2 <= n_kv_heads=2: no KV head is replicated"),
    # one rank's fc1 shard is the whole [gate | up]
    ("megatron_fc1_rank_concat", ("megatron:1", "hf"),
     "source t=1: one rank's shard is the whole tensor"),
])
def test_a_declared_identity_says_why(name, conversion, reason):
    conv = Conversion(SMALL, endpoint(conversion[0]), endpoint(conversion[1]))
    assert mutation_by_name(name).identity_reason(conv) == reason


@pytest.mark.parametrize("name, conversion, reason", [
    ("rope_permute_missing", ("hf", "vllm:2"),
     ("no RoPE permute between these conventions (neither or both store Meta's "
     "interleaved-pair order)")),
    ("embedding_split_on_vocab", ("hf", "vllm:2"), "the dst is not meta"),
    ("qkv_bias_not_split", ("hf", "vllm:2"), "the config has no qkv bias"),
    ("output_stale_copy", ("hf", "vllm:2"), None),
])
def test_a_mutation_says_where_it_cannot_occur(name, conversion, reason):
    conv = Conversion(SMALL, endpoint(conversion[0]), endpoint(conversion[1]))
    assert mutation_by_name(name).not_applicable(conv) == reason


def test_the_k_permute_with_n_heads_is_exempt_where_the_wrong_view_raises():
    config = SMALL.replace(head_dim=6)  # k: 2 KV heads x 6 = 12 rows, not 8 heads of pairs
    with pytest.raises(RuntimeError):
        permute(torch.zeros(config.kv_rows, 4), config.n_heads)  # the bug is loud here
    conv = Conversion(config, endpoint("meta"), endpoint("hf"))
    assert "loud, not silent" in mutation_by_name("rope_k_permuted_with_n_heads").not_applicable(conv)


def test_every_mutation_names_the_public_bug_it_models_and_unknown_names_are_rejected():
    assert all(m.models and m.description for m in MUTATIONS.values())
    assert len(MUTATIONS) == len(DENSE_MUTATIONS) + len(MOE_MUTATIONS) + len(
        PIPELINE_MUTATIONS) == 12 + 11 + 5
    with pytest.raises(UnknownMutation, match="unknown conversion mutation 'nope'; known: "):
        mutation_by_name("nope")
