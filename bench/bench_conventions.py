"""Cost of the cross-convention sweep against the bare forwards it must run, side by side.

    python bench/bench_conventions.py [--rounds N] [--max-degree T]

The sweep: every source and every destination (convention, degree) that can store TOY_KV4
(``plain``, ``megatron``, ``vllm``, ``hf``, ``meta`` at each degree up to ``--max-degree``,
vLLM's replicated KV heads included), each pair converted by the harness's own converter
(``conventions.convert``: gather the canonical model through the source's index maps, cut
the destination's) and judged by ``ConversionChecker.verdict`` (validation, a bit-exact
comparison with the destination's declared shards; the destination's forward runs once per
destination, and only again for shards that differ, which none do here).

"bare" is the minimum any such sweep needs: parameters from the seed, one reference forward,
and per destination its declared shards and one forward reading them as that framework
does (``forward_inputs``, then ``ShardedModel``). "+converts" adds the conversion of every
pair, without validation or comparison. Rounds are interleaved (bare, +converts, sweep, bare,
...) so machine noise hits all three alike; medians shown.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from weight_sync_bench import TOY_KV4
from weight_sync_bench.check.convert import conversion_checker
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.conventions import (
    CONVENTIONS,
    convert,
    endpoint,
    forward_inputs,
    materialize,
    reading_plan,
)
from weight_sync_bench.model.config import init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET


def endpoints(config, max_degree):
    return [endpoint(f"{name}:{t}") for name, conv in CONVENTIONS.items()
            for t in conv.supported_degrees(config, max_degree)]


def bare(config, eps, with_converts=False):
    params = init_params(config, 0)
    tokens = make_tokens(config, TOKEN_SEED_OFFSET)
    ReferenceModel(config, params)(tokens)
    declared = {}
    for ep in eps:
        declared[str(ep)] = shards = materialize(ep.pieces(config), params)
        plan = reading_plan(ep.convention, config, ep.degree)
        ShardedModel(plan.forward.config,
                     forward_inputs(shards, ep.convention, config, ep.degree),
                     InProcessCollective(ep.degree), embedding=plan.forward.embedding)(tokens)
    if with_converts:
        for src in eps:
            for dst in eps:
                convert(declared[str(src)], src, dst, config)


def sweep(config, eps):
    checker = conversion_checker(config)  # the committed phase 1a floor of TOY_KV4
    for src in eps:
        shards = checker.source(src)
        for dst in eps:
            verdict = checker.verdict(convert(shards, src, dst, config), src=src, dst=dst)
            assert verdict.passed, str(verdict)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-degree", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = TOY_KV4
    eps = endpoints(config, args.max_degree)
    print(f"{config.name}: {len(eps)} endpoints ({', '.join(map(str, eps))}), "
          f"{len(eps) ** 2} ordered pairs\n")
    sweep(config, eps)  # warm-up (and the claim: every pair passes)
    b, c, s = [], [], []
    for _ in range(args.rounds):
        b.append(timed(bare, config, eps))
        c.append(timed(bare, config, eps, with_converts=True))
        s.append(timed(sweep, config, eps))
    mb, mc, ms = (statistics.median(x) for x in (b, c, s))
    print(f"{'bare s':>8}  {'+converts s':>11}  {'sweep s':>8}  {'sweep / bare':>12}  "
          f"{'sweep / +converts':>17}  {'ms per pair':>11}")
    print(f"{mb:8.2f}  {mc:11.2f}  {ms:8.2f}  {ms / mb:11.2f}x  {ms / mc:16.2f}x  "
          f"{1e3 * ms / len(eps) ** 2:11.1f}")
    print(f"\nmedians of {args.rounds} interleaved rounds, one torch thread")


if __name__ == "__main__":
    main()
