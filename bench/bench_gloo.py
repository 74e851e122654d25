"""Phase 1b over gloo against phase 1a in-process, side by side in one run (TOY, t=2).

- per-check cost: phase 1a (``init_params``, ``split``, ``ShardedModel`` over
  ``InProcessCollective``) against phase 1b through a warm ``RankPool`` (parameters built on
  rank 0 from the seed, ``GlooTransport``, ``ShardedModel`` over ``GlooCollective``, logits
  back), and phase 1b with the parameters built here and shipped (``shards=``);
- the pool's start-up: first (the forkserver imports torch once) and a restart;
- ``GlooTransport`` bytes/s against a local ``clone`` of the same bytes.

Medians over the repetitions; prints, asserts nothing. ``python bench/bench_gloo.py [reps]``
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from weight_sync_bench.check.forwards import run_phase1b
from weight_sync_bench.collectives.gloo.pool import RankPool
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import TOY, init_params, make_tokens
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.sharded import ShardedModel

DEGREE = 2


def timed(fn, reps: int) -> tuple[float, list]:
    """Median seconds of ``fn(rep)`` over ``reps`` calls, after one warm-up; and the results."""
    fn(-1)
    seconds, results = [], []
    for rep in range(reps):
        start = time.perf_counter()
        results.append(fn(rep))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), results


def check_1a(seed: int) -> torch.Tensor:
    params = init_params(TOY, seed)
    shards = split(params, layout_for(TOY), DEGREE)
    with torch.no_grad():
        return ShardedModel(TOY, shards, InProcessCollective(DEGREE))(make_tokens(TOY, seed))[0]


def main(reps: int = 10) -> int:
    torch.set_num_threads(1)
    pool = RankPool(DEGREE)
    start = time.perf_counter()
    pool.start()
    first_start = time.perf_counter() - start
    pool.close()
    start = time.perf_counter()
    pool.start()
    restart = time.perf_counter() - start
    try:
        t_1a, _ = timed(check_1a, reps)
        t_1b, runs = timed(lambda seed: run_phase1b(TOY, DEGREE, param_seed=seed, token_seed=seed,
                                                    pool=pool), reps)

        def shipped(seed: int):
            shards = split(init_params(TOY, seed), layout_for(TOY), DEGREE)
            return run_phase1b(TOY, DEGREE, param_seed=seed, token_seed=seed, pool=pool,
                               shards=shards)

        t_ship, _ = timed(shipped, reps)
    finally:
        pool.close()

    moved = statistics.median(sum(r.total_bytes for r in run.records) for run in runs)
    wire = statistics.median(run.records[0].total_seconds for run in runs)
    shards = split(init_params(TOY, 0), layout_for(TOY), DEGREE)
    tensors = [x for params in shards for x in params.values()]
    assert sum(x.nbytes for x in tensors) == moved
    t_clone, _ = timed(lambda _: [x.clone() for x in tensors], reps)

    print(f"TOY ({TOY.n_params:,} parameters), t={DEGREE}, median of {reps}, one torch thread each")
    print(f"  phase 1a in-process, per check          {t_1a * 1e3:8.1f} ms")
    print(f"  phase 1b through the pool, per check    {t_1b * 1e3:8.1f} ms   "
          f"1b/1a = {t_1b / t_1a:.2f}x (target <= 2x)")
    print(f"  phase 1b, params built here and shipped {t_ship * 1e3:8.1f} ms   "
          f"shipped/seeded = {t_ship / t_1b:.2f}x")
    print(f"  pool start-up, first (forkserver)       {first_start:8.2f} s")
    print(f"  pool restart                            {restart:8.2f} s")
    print(f"  GlooTransport  {moved / 1e6:6.1f} MB in {wire * 1e3:6.1f} ms  "
          f"{moved / wire / 1e9:6.2f} GB/s")
    print(f"  local clone    {moved / 1e6:6.1f} MB in {t_clone * 1e3:6.1f} ms  "
          f"{moved / t_clone / 1e9:6.2f} GB/s   transport speed / clone speed = {t_clone / wire:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:])))
