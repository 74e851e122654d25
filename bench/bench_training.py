"""Cost of one training-equivalence check against the bare reference training it contains.

    python bench/bench_training.py [--rounds N] [--steps K] [--cprofile N] [--fused]
                                   [--torch-comparisons] [--glibc-default]

"bare" is what any such check must do at least once: the dense reference's forward,
backward and AdamW step on the full batch (``train_reference``), from parameters already
drawn. "check" is ``TrainingCase.check``: the same reference, plus the sharded model on
the DP x TP mesh (split, DP replicas over one storage, forward, vocab-parallel loss,
backward, TP and DP gradient reductions, AdamW on every TP rank's shards) and the
comparisons, each shard against its declared slice of the reference. The
"sharded" column is ``train_sharded`` alone. Rounds are interleaved (bare, sharded, check,
bare, ...) so machine noise hits all alike; medians shown.

Then where the time goes: one more check per case with the phases wrapped (``phases.py``:
exclusive wall time of each function, the reference's and the sharded run's told apart),
each phase as a ratio to that case's bare time, the cases side by side; then the check
against the reference's own forward, backward, loss and AdamW step alone (no trace copies),
and the floor no harness change can lower: both training runs by themselves, and the two runs
plus reading every tensor the comparisons compare once (the memory's floor under any
comparison, beside what the comparisons take). ``--cprofile N``
adds cProfile's N hottest functions (by own time) of one check per case. ``--fused`` runs
every case again, in the same run, with torch's fused AdamW on both sides instead of the
single-tensor one every training floor was measured with (it rounds differently, so the
harness cannot switch without re-measuring them): what that change would buy, side by side.
``--torch-comparisons`` adds to every round of every case a check with the comparisons on
their torch path instead of the compiled kernels (``training.kernels``; the path a machine
without a C compiler takes), side by side. The first line says which path the checks took.

The process keeps its freed memory for reuse, as ``wsb train-check`` does
(``memory.keep_freed``): a check holds two runs' traces at once, and glibc's default hands
the difference back to the kernel at every ``free``, so each check touches fresh pages again.
``--glibc-default`` leaves glibc's default (what a library caller's process has); the second
line says which. The allocator is the process's, so the two cannot share one run's rounds:
run both and compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from weight_sync_bench import memory
from weight_sync_bench.model.config import TOY, TOY_KV4
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.training import compare as compare_module
from weight_sync_bench.training import kernels
from weight_sync_bench.training import step as step_module
from weight_sync_bench.training.batches import default_spec
from weight_sync_bench.training.compare import Shards, Trace
from weight_sync_bench.training.floor import SMALL_VARIANTS, thresholds_for
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.optimizer import AdamW
from weight_sync_bench.training.step import TrainingCase

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phases import Phases, hottest, mean_phases, side_by_side, table


def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn()``: this thread's CPU time moves less than the wall
    clock when other work shares the cores."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


TRAINING = ("forward", "backward", "loss", "AdamW step")  # the work both runs must do
SHARDED_TRAINING = ("gradient reductions (TP, CP, DP)", "split to TP shards")


def floor_row(spent: dict[str, float], total: float, read: float) -> list[str]:
    """The check against the reference's bare training work, the share of it that is the
    two training runs themselves, and what the comparisons cannot go below: reading every
    tensor they compare once (``read``, ``read_floor``)."""
    ref = sum(spent.get(f"reference: {k}", 0.0) for k in TRAINING)
    runs = ref + sum(spent.get(f"sharded: {k}", 0.0) for k in TRAINING + SHARDED_TRAINING)
    compared = sum(v for k, v in spent.items() if k.startswith("compare: "))
    return [f"{ref * 1e3:.0f} ms", f"{total / ref:.2f}x", f"{runs / ref:.2f}x",
            f"{(total - runs) / ref:.2f}x", f"{compared / ref:.2f}x", f"{read / ref:.2f}x",
            f"{(runs + read) / ref:.2f}x"]


def compared(case: TrainingCase, ref: Trace, got: Trace) -> list[torch.Tensor]:
    """Every tensor the comparisons of ``case.check`` read, each once: both runs' input and
    parameter gradients, AdamW moments after each step and parameters after the steps they
    compare (the first and the last), every TP rank's shard of them, and the start."""
    steps = sorted({0, len(ref.params) - 1})
    out = [ref.input_grad, got.input_grad]
    for trace in (ref, got):
        for held in (trace.grads, *trace.exp_avg, *trace.exp_avg_sq,
                     *(trace.params[k] for k in steps)):
            for x in held.values():
                out.extend(x.tensors if isinstance(x, Shards) else (x,))
    assert case.params is not None
    return out + list(case.params.values())


def read_floor(tensors: list[torch.Tensor]) -> float:
    """CPU seconds to read each of ``tensors`` once, with the fastest single pass torch has
    (``aminmax``: faster here than ``sum`` or ``amax``): what comparing them cannot go below."""
    start = time.thread_time()
    for x in tensors:
        if x.numel():
            torch.aminmax(x.detach())
    return time.thread_time() - start


def wrapped(phases: Phases) -> Phases:
    """The phases of a check: the reference's and the sharded run's work told apart by the
    enclosing ``train_reference`` / ``train_sharded`` (``{scope}``), then the comparisons."""
    s, c = step_module, compare_module
    phases.wrap(s, "train_reference", "reference: parameter, gradient and state copies",
                scope="reference")
    phases.wrap(s, "train_sharded", "sharded: replicas, trace copies",
                scope="sharded")
    phases.wrap(ReferenceModel, "__call__", "{scope}: forward")
    phases.wrap(ShardedModel, "__call__", "{scope}: forward")
    phases.wrap(F, "cross_entropy", "{scope}: loss")
    phases.wrap(s, "vocab_parallel_token_losses", "{scope}: loss")
    phases.wrap(torch.Tensor, "backward", "{scope}: backward")
    phases.wrap(torch.autograd, "backward", "{scope}: backward")
    phases.wrap(torch.optim.AdamW, "step", "{scope}: AdamW step")
    phases.wrap(s, "moments", "{scope}: AdamW moment copies")
    phases.wrap(s, "split", "{scope}: split to TP shards")
    phases.wrap(s, "held", "{scope}: the shards held for the comparisons")
    phases.wrap(s.TrainStep, "__call__", "{scope}: step bookkeeping, gradient copies")
    phases.wrap(s, "group_backward", "{scope}: model setup, targets")
    for name in ("reduce_replicated", "reduce_over_context", "_reduce_over_dp"):
        phases.wrap(s, name, "{scope}: gradient reductions (TP, CP, DP)")
    phases.wrap(s, "_assemble", "{scope}: input gradient assembly")
    phases.wrap(s, "_spread", "compare: replicas (copies that must be equal)")
    phases.wrap(c, "gradient_deviations", "compare: loss, input and parameter gradients")
    phases.wrap(c, "moment_deviations", "compare: AdamW moments")
    phases.wrap(c, "parameter_deviations", "compare: parameters after the steps")
    phases.wrap(TrainingCase, "check", "check: verdict construction", scope="check")
    return phases


def fused_make(self: AdamW, params):  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                             weight_decay=self.weight_decay, fused=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print cProfile's N hottest functions of one check per case")
    parser.add_argument("--fused", action="store_true",
                        help="also every case with torch's fused AdamW on both sides")
    parser.add_argument("--torch-comparisons", action="store_true",
                        help="also every case with the comparisons on their torch path")
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave glibc handing freed memory back (wsb train-check keeps it)")
    args = parser.parse_args()
    single, built = AdamW.make, kernels.library
    print("comparisons: " + ("the compiled kernels (training.kernels)" if built() is not None
                             else f"torch (training.kernels not built: {kernels.why_not()})"))
    kept = not args.glibc_default and memory.keep_freed()
    print("freed memory: " + ("kept for reuse (memory.keep_freed, as wsb train-check)" if kept
                              else "glibc's default, handed back"))
    torch.set_num_threads(1)
    rows = [["case", "steps", "bare ref f+b+step", "sharded", "check", "check / bare",
             "CPU: bare", "check", "check / bare"]]
    columns: list[tuple[str, float, float, dict[str, float]]] = []
    floors = [["case", "ref f+b+step", "check / it", "training runs alone / it",
               "the rest / it", "comparisons / it", "their read floor / it",
               "runs + read floor / it"]]
    profiles: list[tuple[str, str]] = []
    paths = ("kernels", "torch")[:2 if args.torch_comparisons else 1]
    cases = [(config, mesh, optimizer)
             for optimizer in ("single-tensor", "fused")[:2 if args.fused else 1]
             for config, mesh in ((TOY, Mesh(2, 2)), (TOY_KV4, Mesh(2, 4)),
                                  (SMALL_VARIANTS[1], Mesh(2, 2)))]
    for config, mesh, optimizer in cases:
        AdamW.make = fused_make if optimizer == "fused" else single  # type: ignore[method-assign]
        case = TrainingCase(config, mesh, seed=0, steps=args.steps,
                            spec=default_spec(config, packed=True))
        thresholds = thresholds_for(config)
        def check(case: TrainingCase = case, thresholds: dict[str, float] = thresholds) -> None:
            case.check(thresholds)  # looked up at each call: the wrapped one when wrapped

        def on(path: str) -> None:  # the comparisons' path for the next check
            kernels.library = built if path == "kernels" else (lambda: None)  # type: ignore

        label = f"{config.name} {mesh} packed" + (", fused AdamW" if optimizer == "fused" else "")
        times: dict[str, list[tuple[float, float]]] = {"bare": [], "sharded": []}
        times.update({f"check {path}": [] for path in paths})
        runs: dict[str, list[Phases]] = {path: [] for path in paths}
        case.reference(), case.sharded()  # warm-up: first-touch pages, lazy init
        for path in paths:
            on(path)
            check()
        for _ in range(args.rounds):  # interleaved: bare, sharded, then a check on each path
            times["bare"].append(timed(case.reference))
            times["sharded"].append(timed(case.sharded))
            for path in paths:
                on(path)
                times[f"check {path}"].append(timed(check))
                with wrapped(Phases(time.thread_time)).active() as phases:
                    phases.spent["(total)"] = timed(check)[1]
                runs[path].append(phases)
        on("kernels")
        # after the timed rounds: two traces held alive through them made the check slower
        tensors = compared(case, case.reference(), case.sharded())
        reads = [read_floor(tensors) for _ in range(args.rounds)]
        del tensors
        wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
        for path in paths:
            named = label + (", torch comparisons" if path == "torch" else "")
            key = f"check {path}"
            rows.append([named, str(args.steps), f"{wall['bare'] * 1e3:.0f} ms",
                         f"{wall['sharded'] * 1e3:.0f} ms", f"{wall[key] * 1e3:.0f} ms",
                         f"{wall[key] / wall['bare']:.2f}x", f"{cpu['bare'] * 1e3:.0f} ms",
                         f"{cpu[key] * 1e3:.0f} ms", f"{cpu[key] / cpu['bare']:.2f}x"])
            spent = mean_phases(runs[path])
            total = spent.pop("(total)")
            columns.append((named, cpu["bare"], total, spent))
            floors.append([named] + floor_row(spent, total, statistics.median(reads)))
        if args.cprofile:
            profiles.append((label, hottest(check, args.cprofile)))
    print(table(rows))
    print(f"\nmedians of {args.rounds} interleaved rounds, one torch thread; wall and this "
          "thread's CPU time")
    print("\nwhere the CPU time of one check goes (exclusive, means of the rounds, x that "
          "case's bare CPU median):")
    print(side_by_side(columns))
    print("\nagainst the reference's own forward, backward, loss and AdamW step (the wrapped "
          "buckets, no trace copies), and the floor: both training runs alone (those buckets "
          "of the reference and the sharded run, its reductions and split included), before "
          "any trace is gathered or compared; then the comparisons, against reading every "
          "tensor they compare once (one aminmax each, CPU time, median of the rounds), and "
          "the two training runs plus that read: a check cannot go below it:")
    print(table(floors))
    for label, text in profiles:
        print(f"\ncProfile, one check of {label}, hottest by own time:\n{text}")


if __name__ == "__main__":
    main()
