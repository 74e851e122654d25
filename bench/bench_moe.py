"""Cost of an MoE conversion check against the bare forwards it must run, and of the routing
check on its own, side by side.

    python bench/bench_moe.py [--rounds N]

The check: ``check_convert`` of the harness's own converter (``conventions.convert``) from
``megatron:tp=2,ep=4`` (8 ranks: TP 2, EP 4, expert-TP 2) to each destination, on TOY_MOE
(Qwen3-MoE's block) and TOY_MOE_DS (DeepSeek-V3's), with the committed floor's threshold:
parameters drawn, the reference run (its routing kept as the guard), the source shards cut,
the converter run, the output validated and compared byte for byte with the destination's
declared shards, the destination's forward run once.

"bare" is the minimum any such check needs: the parameters, one reference forward, the
source's declared shards, one conversion, and one forward of the destination reading its
declared shards as that framework does (``forward_inputs``, ``forward_model``), no guard.
"routing" is the routing check alone: the same destination forward with the guard (the
reference's choice on near-tied tokens) against it without, and the guard's count of near ties.
Rounds are interleaved; medians of wall time and of CPU time (this process's) are shown.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from weight_sync_bench import check_convert
from weight_sync_bench.conventions import (
    convert,
    endpoint,
    forward_inputs,
    forward_model,
    materialize,
    reading_plan,
)
from weight_sync_bench.model.config import TOY_MOE, TOY_MOE_DS, init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import RoutingGuard
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET

SOURCE = "megatron:tp=2,ep=4"
DESTINATIONS = ("vllm:4", "vllm:tp=4,ep=4", "hf:experts=fused")


def harness(src, dst, config):
    def fn(shards, degree):
        return convert(shards, src, dst, config)
    return fn


def check(config, dst):
    verdict = check_convert(harness(SOURCE, dst, config), config, SOURCE, dst)
    assert verdict.passed, str(verdict)


def bare(config, dst):
    params = init_params(config, 0)
    tokens = make_tokens(config, TOKEN_SEED_OFFSET)
    ReferenceModel(config, params)(tokens)
    source = materialize(endpoint(SOURCE).pieces(config), params)
    out = convert(source, SOURCE, dst, config)
    target = endpoint(dst)
    plan = reading_plan(target.convention, config, target)
    forward_model(plan.forward, forward_inputs(out, target.convention, config, target))(tokens)


def destination_forward(config, dst, guarded):
    """The destination forward alone, with or without the guard; what it costs to route."""
    params = init_params(config, 0)
    tokens = make_tokens(config, TOKEN_SEED_OFFSET)
    reference = ReferenceModel(config, params)
    reference(tokens)
    target = endpoint(dst)
    plan = reading_plan(target.convention, config, target)
    inputs = forward_inputs(materialize(target.pieces(config), params), target.convention,
                            config, target)
    guard = RoutingGuard(reference.routings, 1e-3) if guarded else None

    def run():
        forward_model(plan.forward, inputs, guard=guard)(tokens)
    return run, guard


def clocked(fn, *args):
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'config':<11} {'destination':<17} {'bare s':>7} {'check s':>8} "
          f"{'check/bare wall':>15} {'check/bare cpu':>14} {'route/forward':>13} {'near ties':>10}")
    for config in (TOY_MOE, TOY_MOE_DS):
        for dst in DESTINATIONS:
            check(config, dst)  # warm-up, and the claim: it passes
            plain, _ = destination_forward(config, dst, False)
            guarded, guard = destination_forward(config, dst, True)
            b, c, p, g = [], [], [], []
            for _ in range(args.rounds):
                b.append(clocked(bare, config, dst))
                c.append(clocked(check, config, dst))
                p.append(clocked(plain))
                g.append(clocked(guarded))
            med = [tuple(statistics.median(x[k] for x in runs) for k in (0, 1))
                   for runs in (b, c, p, g)]
            (bw, bc), (cw, cc), (pw, _), (gw, _) = med
            near, total = guard.near_ties()
            print(f"{config.name:<11} {dst:<17} {bw:7.2f} {cw:8.2f} {cw / bw:14.2f}x "
                  f"{cc / bc:13.2f}x {gw / pw:12.2f}x {near:>4}/{total:<5}")
    print(f"\nsource {SOURCE}; medians of {args.rounds} interleaved rounds, one torch thread; "
          "route/forward: the destination forward with the routing guard over it without")


if __name__ == "__main__":
    main()
