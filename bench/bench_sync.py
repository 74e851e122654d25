"""Phase 2 figures, side by side in one run: bytes counted at the transport against B_min and
the naive gather-then-scatter, wall time against T_min, bytes sent max/mean, plan time,
memory per rank.

One row per layout pair (TOY-sized geometries, world sizes up to 8): TP a -> b for a, b in
1, 2, 4, 8 (8 on 8 KV heads), vLLM's KV
replication over 1, 2 and 8 KV heads, FSDP ``Shard(0)`` -> TP, DP x TP -> TP, fused
tensors, Megatron -> vLLM and -> Meta, and Megatron's pipeline stages and experts (TP x PP,
virtual stages, x EP) -> vLLM, HF and Megatron. Each row: ``reps`` interleaved rounds of the
harness's executor into fresh destination storage, the same into existing storage
(``into="existing"``: the tensors an engine already holds, allocated and filled before the
timed region) and the naive ``gather_scatter`` (every run checked element by element), the
gloo point-to-point bandwidth calibrated in the same task, and the run's own wire pattern
replayed at its own concurrency (``calibrate_pattern``), medians. The forward runs once into
each storage per row where a phase 1b floor exists (TOY, TOY_KV4). The times table puts T
fresh and T existing against the issue's ``T_min`` (one pair's bandwidth) and against
``T_min@W`` (the same formula at the pattern's bandwidth), and says which rows meet 1.5x
under which. The overhead table puts the executor against the executor before (``before``:
the plan's cut into messages and its copy runs made again on every rank inside the timed
region, and
``staging="per_message"``, a fresh buffer per staged message), into existing storage, in
the same rounds. Then ``wire_profile``: raw traffic that shows what
T holds beside the bytes T_min counts. Prints; asserts only that every run moved exactly B_min.

    python bench/bench_sync.py [reps] [WORD,WORD...]   # only the rows whose label has one
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from weight_sync_bench.collectives.gloo.pool import RankPool
from weight_sync_bench.model.config import TOY, TOY_KV4, TOY_MOE
from weight_sync_bench.sync import SyncSession, execute_plan, gather_scatter

KV1, KV8 = TOY.replace(name="toy_kv1", n_kv_heads=1), TOY.replace(name="toy_kv8", n_kv_heads=8)
ROWS = (
    [(TOY_KV4, f"plain:{a}", f"plain:{b}", 1) for a in (1, 2, 4) for b in (1, 2, 4) if a != b]
    + [(KV8, f"plain:{a}", f"plain:{b}", 1) for a, b in ((8, 1), (8, 2), (8, 4), (1, 8),
                                                           (2, 8), (4, 8))]
    + [(KV1, "megatron:1", "vllm:4", 1), (TOY, "megatron:2", "vllm:4", 1),
       (TOY, "vllm:8", "megatron:2", 1), (KV8, "megatron:8", "vllm:4", 1)]
    + [(TOY_KV4, "fsdp:4", "vllm:2", 1), (TOY_KV4, "fsdp:8", "megatron:4", 1)]
    + [(TOY_KV4, "megatron:2", "vllm:4", 2), (TOY_KV4, "megatron:4", "vllm:2", 2)]
    + [(TOY_KV4, "megatron:4", "vllm:2", 1), (TOY_KV4, "megatron:2", "meta:2", 1)]
    # pipeline stages and experts (issue 25): Megatron TP x PP (x EP) -> vLLM / HF / Megatron
    + [(TOY, "megatron:tp=2,pp=2", "vllm:4", 1), (TOY, "vllm:4", "megatron:tp=2,pp=2,vpp=2", 1),
       (TOY, "megatron:tp=1,pp=2", "vllm:2", 2), (TOY_MOE, "megatron:tp=2,pp=2,ep=2", "hf", 1),
       (TOY_MOE, "megatron:tp=2,ep=4", "megatron:tp=1,pp=4,ep=2", 1),
       # into vLLM's stacked experts with its EP, and back
       (TOY_MOE, "megatron:tp=2,pp=2,ep=2", "vllm:tp=4,ep=4", 1),
       (TOY_MOE, "vllm:tp=4,ep=4", "megatron:tp=2,pp=2,ep=2", 1)]
)
FORWARD = (TOY, TOY_KV4, TOY_MOE)  # the geometries with a measured phase 1b floor


def before(ctx, rank, local, plan):
    """The executor before: the plan's cut into messages (and its copy runs) made again inside
    the timed region
    (a plan reached the ranks without it) and a fresh buffer per staged message."""
    plan._messages.clear()
    plan._local.clear()
    return execute_plan(ctx, rank, local, plan, staging="per_message")


def row(pool: RankPool, config, src: str, dst: str, dp: int, reps: int) -> dict:
    forward = config in FORWARD
    with SyncSession(config, src, dst, dp=dp, pool=pool, forward=forward) as session:
        first = session.run(execute_plan, calibrate=True)  # with the forward, once
        existing = [session.run(execute_plan, calibrate=True, into="existing")]  # and here
        ours, naive, patterns, per_message = [first], [], [], []
        for _ in range(reps):  # interleaved rounds
            naive.append(session.run(gather_scatter, calibrate=True, forward=False))
            ours.append(session.run(execute_plan, calibrate=True, forward=False))
            existing.append(session.run(execute_plan, calibrate=True, forward=False,
                                        into="existing"))
            per_message.append(session.run(before, calibrate=True, forward=False,
                                           into="existing"))
            patterns.append(session.calibrate_pattern())
    assert all(r.bytes_moved == first.bytes_moved == first.b_min
               for r in ours + existing + per_message)
    return {"label": f"{config.name} {first.plan.src} -> {first.plan.dst}", "first": first,
            "ours": ours, "existing": existing, "naive": naive, "patterns": patterns,
            "per_message": per_message}


PROBE_BYTES = 38_666_240  # TOY_KV4 megatron:2 -> vllm:1's B_min: one rank's whole receive


def probe_task(ctx, *, mode: str, reps: int) -> float:
    """Median seconds of one pattern of raw traffic (no plan, no packing), the pieces T is
    made of beside the wire (``wire_profile``). Ranks 0..degree-1 of the pool."""
    from weight_sync_bench.sync.execute import CountingP2P, huge_pages, rss_reset

    import torch.distributed as dist

    n = PROBE_BYTES // 4
    bucket = (4 << 20) // 4
    p2p = CountingP2P(ctx.group, ctx.rank)
    src, warm = torch.ones(n), torch.empty(n)
    times = []
    for _ in range(reps + 1):  # the first warms the connections up
        rss_reset()  # as ``verify.run_fn`` does before every reshard
        dist.barrier(group=ctx.group)
        started = time.perf_counter()
        if mode == "zero":  # the old destination storage: zeros of fresh pages
            torch.zeros(n)
        elif mode == "ring":  # every rank sends its whole share to the next at once
            into = warm[: n // ctx.degree]
            p2p.exchange([((ctx.rank + 1) % ctx.degree, src[: n // ctx.degree])],
                         [((ctx.rank - 1) % ctx.degree, into)], tag="ring")
        elif ctx.rank < 2:
            into = {"fresh": torch.empty(n), "huge": huge_pages(torch.empty(n))}.get(mode, warm)
            if mode == "per_message":  # one wait per 4 MiB message
                for k in range(0, n, bucket):
                    p2p.exchange([(1, src[k:k + bucket])] if ctx.rank == 0 else [],
                                 [(0, into[k:k + bucket])] if ctx.rank == 1 else [], tag="m")
            else:
                p2p.exchange([(1, src)] if ctx.rank == 0 else [],
                             [(0, into)] if ctx.rank == 1 else [], tag="one")
        dist.barrier(group=ctx.group)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def wire_profile(pool: RankPool, bandwidth: float, reps: int) -> list[str]:
    """Where T goes beside the bytes: the same 38.7 MB from rank 0 to rank 1 in one exchange
    into warm memory (what the calibration measures), into fresh pages, as 4 MiB messages
    each waited for; zeroing it; and 2 to 8 ranks all sending at once on this machine's
    cores (the calibration runs two)."""
    t_min = PROBE_BYTES / bandwidth
    one = lambda mode, degree=2: pool.run(probe_task, degree,  # noqa: E731
                                          kwargs={"mode": mode, "reps": reps})[0]
    rows = [("one exchange, warm destination", one("warm")),
            ("one exchange, fresh destination pages", one("fresh")),
            ("one exchange, fresh pages, huge-page advice", one("huge")),
            ("4 MiB messages, one wait each, warm", one("per_message")),
            ("zeroing the destination (fresh pages)", one("zero"))]
    lines = [f"where the time goes: {PROBE_BYTES / 1e6:.1f} MB rank 0 -> rank 1, "
             f"T_min {t_min * 1e3:.1f} ms at the calibrated {bandwidth / 1e9:.2f} GB/s"]
    lines += [f"  {label:<44} {t * 1e3:7.1f} ms  {t / t_min:5.2f}x T_min" for label, t in rows]
    for degree in (2, 4, 8):
        t = one("ring", degree)
        share = PROBE_BYTES // degree
        lines.append(f"  {degree} ranks each sending {share / 1e6:5.1f} MB at once{'':<9} "
                     f"{t * 1e3:7.1f} ms  {t / (share / bandwidth):5.2f}x its T_min "
                     f"({os.cpu_count()} cores)")
    return lines


def times(rows: list[dict]) -> str:
    """Wall time into fresh and into existing destination storage, each against two bounds:
    the issue's ``T_min`` (the bandwidth of one pair, ranks 0 and 1 alone) and ``T_min@W``,
    the same formula at the bandwidth of the run's own wire pattern (every rank at once,
    the executor's shift steps, messages and exchanges, warm buffers: ``calibrate_pattern``,
    best of 3 replays, the median of those over the rounds); and which rows meet 1.5x."""
    head = (f"{'layout pair':<36} {'W':>2} {'T fresh':>8} {'T exist':>8} {'T_min':>7} "
            f"{'T_min@W':>7} {'pair GB/s':>9} {'@W GB/s':>7} {'fresh/T_min':>11} "
            f"{'exist/T_min':>11} {'fresh/@W':>8} {'exist/@W':>8}  meets 1.5x")
    lines = [("times (ms; ratios over each bound; pair: the issue's T_min, one pair's "
              "calibrated bandwidth; @W: the same formula at the bandwidth of the run's own "
              "pattern)"), head]
    meets = {(b, s): 0 for b in ("T_min", "T_min@W") for s in ("fresh", "existing")}
    for r in rows:
        first = r["first"]
        fresh = statistics.median(x.seconds for x in r["ours"])
        exist = statistics.median(x.seconds for x in r["existing"])
        pair = statistics.median(x.bandwidth for x in r["ours"] + r["existing"] if x.bandwidth)
        wide = statistics.median(p.bandwidth for p in r["patterns"])
        bounds = {"T_min": first.bound(pair), "T_min@W": first.bound(wide)}
        ok = []
        for b, bound in bounds.items():
            for s, t in (("fresh", fresh), ("existing", exist)):
                if t <= 1.5 * bound:
                    meets[(b, s)] += 1
                    ok.append(f"{s}@{'W' if b.endswith('W') else 'pair'}")
        lines.append(
            f"{r['label']:<36} {first.plan.world:>2} {fresh * 1e3:>8.1f} {exist * 1e3:>8.1f} "
            f"{bounds['T_min'] * 1e3:>7.1f} {bounds['T_min@W'] * 1e3:>7.1f} "
            f"{pair / 1e9:>9.2f} {wide / 1e9:>7.2f} {fresh / bounds['T_min']:>11.2f} "
            f"{exist / bounds['T_min']:>11.2f} {fresh / bounds['T_min@W']:>8.2f} "
            f"{exist / bounds['T_min@W']:>8.2f}  {' '.join(ok) or '-'}")
    lines.append("rows meeting T <= 1.5 x bound, of " + str(len(rows)) + ": " + "; ".join(
        f"{s} storage vs {b}: {n}" for (b, s), n in meets.items()))
    lines.append("")
    lines.append("the executor's own overhead, into existing storage, same rounds: before (the "
                 "plan's cut into messages and runs made on every rank inside the timed region, a fresh "
                 "buffer per staged message) and after (the cut made once by the session and "
                 "shipped with the plan; two staging arenas per call)")
    lines.append(f"{'layout pair':<36} {'staged MB':>9} {'cut ms':>6} {'T before':>8} "
                 f"{'T after':>7} {'after/before':>12} {'before/T_min':>12} {'after/T_min':>11}")
    for r in rows:
        first = r["first"]
        pair = statistics.median(x.bandwidth for x in r["ours"] + r["existing"] if x.bandwidth)
        bound = first.bound(pair)
        t_before = statistics.median(x.seconds for x in r["per_message"])
        t_after = statistics.median(x.seconds for x in r["existing"])
        lines.append(f"{r['label']:<36} {staged_bytes(first.plan) / 1e6:>9.2f} "
                     f"{cut_seconds(first.plan) * 1e3:>6.1f} {t_before * 1e3:>8.1f} "
                     f"{t_after * 1e3:>7.1f} {t_after / t_before:>12.2f} "
                     f"{t_before / bound:>12.2f} {t_after / bound:>11.2f}")
    return "\n".join(lines)


def staged_bytes(plan) -> int:
    """Bytes the executor stages (packs at the sender plus unpacks at the receiver)."""
    from weight_sync_bench.sync.execute import DEFAULT_BUCKET, _staging

    return sum(_staging(plan, m, side) for ms in plan.messages(DEFAULT_BUCKET).values()
               for m in ms for side in ("src", "dst"))


def cut_seconds(plan) -> float:
    """Best of 3 of ``Plan.messages`` on a copy of the plan that has no cut yet (here, in
    the parent: what each rank paid before)."""
    from weight_sync_bench.sync.execute import DEFAULT_BUCKET

    best = float("inf")
    for _ in range(3):
        fresh = plan.with_transfers(list(plan.transfers), plan.mutation)
        started = time.perf_counter()
        fresh.messages(DEFAULT_BUCKET)
        best = min(best, time.perf_counter() - started)
    return best


def _label(config, src: str, dst: str, dp: int) -> str:
    return f"{config.name} {src}{f' x dp{dp}' if dp > 1 else ''} -> {dst}"


def main(reps: int = 3, only: str = "") -> int:
    torch.set_num_threads(1)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.perf_counter()
    pool = RankPool(8)
    try:
        rows = [row(pool, *case, reps) for case in ROWS
                if not only or any(word in _label(*case) for word in only.split(","))]
        bandwidths = [o.bandwidth for r in rows for o in r["ours"] if o.bandwidth]
        profile = wire_profile(pool, statistics.median(bandwidths), max(reps, 3))
    finally:
        pool.close()
    print(f"phase 2 resharding, {reps} interleaved rounds per row (medians), one torch thread "
          f"per rank, 8 rank processes on {os.cpu_count()} cores; load average before "
          f"{load_before}, after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    head = (f"{'layout pair':<36} {'B_min MB':>9} {'moved/B_min':>11} {'naive/B_min':>11} "
            f"{'T ms':>7} {'T_min ms':>8} {'T/T_min':>7} {'naive ms':>8} {'sent max/mean':>13} "
            f"{'plan ms':>7} {'staging MB':>10} {'RSS+ MB':>7} {'naive RSS+':>10} "
            f"{'checks':>12}")
    print(head)
    for r in rows:
        first, ours, naive = r["first"], r["ours"], r["naive"]
        t = statistics.median(x.seconds for x in ours)
        t_min = statistics.median(x.t_min or 0.0 for x in ours)
        t_naive = statistics.median(x.seconds for x in naive)
        staging = max(x.staging_peak for x in first.ranks) / 1e6
        rss = max((x.rss_extra or 0) for o in ours for x in o.ranks) / 1e6
        naive_rss = max((x.rss_extra or 0) for o in naive for x in o.ranks) / 1e6
        balance = first.sent_balance
        verdicts = [x.verdict for x in (first, r["existing"][0]) if x.verdict is not None]
        checks = ("elements " + ("ok" if all(o.elements_passed for o in ours + naive
                                             + r["existing"] + r["per_message"]) else "FAIL")
                  + ("" if not verdicts else
                     f", fwd {max(v.ratio for v in verdicts):.2g}x"
                     if all(v.passed for v in verdicts) else ", fwd FAIL"))
        ratio = first.bytes_moved / first.b_min if first.b_min else float("nan")
        print(f"{r['label']:<36} {first.b_min / 1e6:>9.2f} {ratio:>11.3f} "
              f"{first.naive / first.b_min if first.b_min else float('nan'):>11.2f} "
              f"{t * 1e3:>7.1f} {t_min * 1e3:>8.1f} {t / t_min if t_min else float('nan'):>7.2f} "
              f"{t_naive * 1e3:>8.1f} {balance if balance else float('nan'):>13.3f} "
              f"{first.plan.build_seconds * 1e3:>7.2f} {staging:>10.2f} {rss:>7.1f} "
              f"{naive_rss:>10.1f} {checks:>12}")
    print()
    print(times(rows))
    largest = max(r["first"].largest_param for r in rows) / 1e6
    print(f"calibrated gloo p2p bandwidth: median {statistics.median(bandwidths) / 1e9:.2f} GB/s "
          f"(min {min(bandwidths) / 1e9:.2f}, max {max(bandwidths) / 1e9:.2f}); largest full "
          f"parameter {largest:.1f} MB; staging bound 2 x bucket = 8.4 MB")
    print("moved: counted at each rank's CountingP2P (fresh and existing storage: both "
          "exactly B_min, asserted); T: the slowest rank from a common barrier; "
          "T_min = max over ranks of max(sent, received) / bandwidth; RSS+: the kernel's "
          "high-water mark above the inputs, less the outputs, worst rank, fresh storage; "
          "checks: every run of both storages and the naive, the forward once into each")
    print()
    print("\n".join(profile))
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:3]))))
