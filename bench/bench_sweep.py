"""Cost of the phase-1a sweep against the bare forwards it must run, side by side.

    python bench/bench_sweep.py [--rounds N]

"bare" is the minimum any sweep needs: parameters from the seed, one reference forward, and
per destination degree the declared split and one sharded forward. "sweep" is `sweep()` over
every ordered pair: the same, plus per pair one reshard and one bit-exact comparison with
the destination's declared split (streamed one parameter at a time). The pair
work is data movement of the whole model (74 MiB), independent of the token count, so the
overhead is shown at the floor's token shape (2 x 16) and at longer sequences. Rounds are
interleaved (bare, sweep, bare, sweep, ...) so machine noise hits both alike; medians shown.
Also: split+gather throughput against torch.clone of the same bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from weight_sync_bench import (
    TOY,
    TOY_KV4,
    Checker,
    ReferenceModel,
    gather,
    layout_for,
    reshard,
    split,
    sweep,
)
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.model.config import init_params, make_tokens
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET


def bare(config, with_reshards=False):
    params = init_params(config, 0)
    tokens = make_tokens(config, TOKEN_SEED_OFFSET)
    ReferenceModel(config, params)(tokens)
    layout = layout_for(config)
    degrees = layout.supported_degrees()
    splits = {t: split(params, layout, t) for t in degrees}
    for t in degrees:
        inprocess_forward(config, splits[t], tokens)
    if with_reshards:
        for src in degrees:
            for dst in degrees:
                reshard(splits[src], layout, dst)


def full_sweep(config):
    # the built-in token shape reads the committed threshold; longer sequences (not what the
    # floor was measured on) only measure cost, so they take a threshold that cannot fail
    threshold = None if config in (TOY, TOY_KV4) else 1.0
    verdicts = sweep(config, checker=Checker(config, threshold=threshold))
    assert all(v.passed for v in verdicts)


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("bare: params, reference, one split and one forward per destination; +reshards: and\n"
          "the reshard every pair needs; sweep: all that, plus validation and bit-exact comparison\n")
    print(f"{'config':8}  {'tokens':>6}  {'pairs':>5}  {'bare ms':>8}  {'+reshards':>9}  "
          f"{'sweep ms':>8}  {'vs bare':>8}  {'vs +reshards':>12}")
    longer = [TOY_KV4.replace(name="toy_kv4", seq_len=s) for s in (64, 256)]
    for config in (TOY, TOY_KV4, *longer):
        full_sweep(config)  # warm-up
        b, r, s = [], [], []
        for _ in range(args.rounds):
            b.append(timed(bare, config))
            r.append(timed(bare, config, True))
            s.append(timed(full_sweep, config))
        mb, mr, ms = statistics.median(b), statistics.median(r), statistics.median(s)
        pairs = len(layout_for(config).supported_degrees()) ** 2
        tokens = config.batch * config.seq_len
        print(f"{config.name:8}  {tokens:>6}  {pairs:>5}  {mb * 1e3:8.1f}  {mr * 1e3:9.1f}  "
              f"{ms * 1e3:8.1f}  {ms / mb - 1:+8.1%}  {ms / mr - 1:+12.1%}")

    params = init_params(TOY_KV4, 0)
    layout = layout_for(TOY_KV4)
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    print(f"\nsplit+gather vs clone, TOY_KV4 ({nbytes / 2**20:.1f} MiB), median of {args.rounds}:")
    print(f"{'t':>2}  {'split+gather GB/s':>17}  {'clone GB/s':>10}  ratio")
    for t in layout.supported_degrees():
        sg, cl = [], []
        for _ in range(args.rounds):
            sg.append(timed(lambda: gather(split(params, layout, t), layout)))
            cl.append(timed(lambda: [p.clone() for p in params.values()]))
        gsg, gcl = nbytes / statistics.median(sg) / 1e9, nbytes / statistics.median(cl) / 1e9
        print(f"{t:>2}  {gsg:17.2f}  {gcl:10.2f}  {gsg / gcl:.2f}x")


if __name__ == "__main__":
    main()
