"""``wsb fuzz``, ``wsb mutants``, ``wsb replay``: the fuzz layer's commands.

    wsb fuzz [--minutes M | --examples N] [--phase 1a|1b] [--profile P] [--mutation NAME ...]
    wsb fuzz --moe [--minutes M | --examples N]
    wsb fuzz --splitter | --resharder MOD:FN [--src S] [--dst D] [--max-d-model N]
             [--kv-heads LO-HI] [--no-gqa | --gqa-only] [--vocab-multiple K] [--domain F=LO-HI]
    wsb fuzz --converter MOD:FN --from CONVENTION[:T] --to CONVENTION[:T] [domain options]
    wsb mutants [--examples N] [--profile P]
    wsb replay [PATH ...] [--max-gib G] [--max-gflop F]

``register(subparsers)`` adds them to ``wsb``'s parser; each handler returns its exit status
(``output.EXIT_CODES``) and is the only place here that prints. Progress goes to stderr,
tables (or ``--json`` records) to stdout.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any

from weight_sync_bench.check.forwards import phase_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.check.user_code import load_function
from weight_sync_bench.conventions.mutations import MUTATIONS as CONVERSION_MUTATIONS
from weight_sync_bench.cli.output import (
    EXIT_FAILED,
    EXIT_HARNESS,
    EXIT_OK,
    EXIT_USAGE,
    Output,
    add_deadline_option,
    add_limit_options,
    add_output_options,
    apply_deadline,
    count,
    interrupt_code,
    pending_interrupt,
    positive,
    seed,
)
from weight_sync_bench.cli.records import FUZZ_SUMMARY, counterexample_record, replay_record
from weight_sync_bench.errors import RankFailure, WsbError
from weight_sync_bench.tolerance.artifacts import PHASES
from weight_sync_bench.paths import user_corpus_dir


def _run_fuzz(args: argparse.Namespace, out: Output, **kwargs: object):  # -> FuzzReport
    from weight_sync_bench.fuzz.runner import FuzzReport, Progress, fuzz
    from weight_sync_bench.tolerance.sampled import environment_notes

    apply_deadline(args.deadline, args.phase == "1b")
    for note in environment_notes(args.phase):  # --strict-env: refused here instead
        out.note(note)
    line = out.progress()
    events = fuzz(phase=args.phase, profile=args.profile, master_seed=args.seed,
                  forward=phase_forward(args.phase), **kwargs)  # type: ignore[arg-type]
    # An interrupt is the run's wherever it lands (its Terminated too): while the generator
    # runs, it ends the run there with the report of what ran; here, between two of its
    # steps (the line drawn, the next step asked for), it is thrown into the generator at
    # its yield, which does the same. One signalled but swallowed (``pending_interrupt``)
    # is thrown in at the next step.
    item: object = None
    interrupt: BaseException | None = None
    try:
        while not isinstance(item, FuzzReport):
            try:
                if interrupt is None:
                    item = next(events)
                elif inspect.getgeneratorstate(events) == inspect.GEN_SUSPENDED:
                    item = events.throw(interrupt)
                else:  # landed as the generator ended: no report to take
                    raise interrupt
                if isinstance(item, Progress):
                    line.show(item.line())
                    interrupt = pending_interrupt()
            except KeyboardInterrupt as exc:
                if interrupt is exc:  # the generator's own raise of the one thrown in
                    raise
                interrupt = exc
    finally:
        line.close()
    return item


def _tally_record(t: Any) -> dict[str, Any]:
    live = t.examples - t.identity
    return {"property": t.prop, "mutation": t.mutation, "examples": t.examples,
            "identity": t.identity, "failures": t.failures, "killed": t.killed,
            "min_ratio": t.min_ratio if live else None, "max_ratio": t.max_ratio,
            "min_at": str(t.min_at) if t.min_at else None,
            "new_entries": [str(p) for p in t.new_entries], "faults": len(t.faults)}


def _fault_record(f: Any) -> dict[str, Any]:
    return {"property": f.label, "entry": None, "type": type(f.error).__name__, "rank": f.rank,
            "how": f.how, "breadcrumb": f.error.breadcrumb,
            "case": str(f.case) if f.case else None,
            "message": str(f.error).splitlines()[0] if str(f.error) else ""}


def _write_summary(report: Any, args: argparse.Namespace, command: str,
                   budget: dict[str, Any]) -> tuple[Path | None, str]:
    """Write the campaign summary (``fuzz.summary``) to ``--summary PATH``, else under
    ``paths.fuzz_dir()``; the path (None where there is nowhere to write) and a line saying so."""
    from weight_sync_bench.errors import MissingArtifacts
    from weight_sync_bench.fuzz.summary import build_summary, write_summary

    summary = build_summary(report, phase=args.phase, command=command, budget=budget)
    try:
        path = write_summary(summary, args.summary)
    except MissingArtifacts as exc:
        return None, f"campaign summary not written: {exc} (or pass --summary PATH)"
    except OSError as exc:
        if args.summary is None:  # a by-product: the run's report still prints, its code holds
            return None, (f"campaign summary not written: {exc.filename or 'its directory'}: "
                          f"{exc.strerror or exc} (or pass --summary PATH)")
        raise WsbError(f"--summary {args.summary}: cannot write the campaign summary "
                       f"({exc.strerror or exc})") from None
    return path, f"campaign summary: {path}"


def _finish(report: Any, out: Output, *, failed: bool, matrix: bool,
            extra: list[str] = (), summary: Path | None = None) -> int:
    """The closing table, failures and harness faults, the summary; the exit status."""
    from weight_sync_bench.fuzz.runner import format_report

    kind = "mutant" if matrix else "property"
    for t in report.tallies:
        out.record(kind, **_tally_record(t))
    for failure in report.failures:
        out.record("counterexample", **counterexample_record(failure))
    for fault in report.faults:
        out.record("harness_fault", **_fault_record(fault))
    out.text(format_report(report, matrix=matrix))
    for failure in report.failures:
        out.text(f"\nFAIL {failure}")
    for fault in report.faults:
        out.text(f"\nHARNESS FAULT (not a counterexample: not shrunk, not written to the "
                 f"corpus; the rank pool restarts on its next task): {fault}")
    for line in extra:
        out.text(line)
    if report.interrupted is not None:
        code = interrupt_code(report.interrupted)
        out.text(f"\ninterrupted: the summary above covers the {report.examples} examples "
                 "that ran")
    elif failed:
        code = EXIT_FAILED
    elif report.faults:
        code = EXIT_HARNESS
    elif report.examples == 0:
        code = EXIT_USAGE
        out.text("\ntried no example: nothing was checked (the budget ran out before the first "
                 "example, or the profile generates none and no corpus entry applies)")
    else:
        code = EXIT_OK
    out.summary(code, examples=report.examples, failures=len(report.failures),
                harness_faults=len(report.faults), elapsed=report.elapsed,
                profile=report.profile, master_seed=report.master_seed,
                corpus=report.corpus, new_entries=[str(p) for p in report.new_entries],
                stopped=report.stopped, summary_file=str(summary) if summary else None,
                found=None)
    return code


def cmd_fuzz(args: argparse.Namespace) -> int:
    from weight_sync_bench.fuzz.runner import find_smallest

    out = Output(args)
    if args.splitter or args.resharder or args.converter:
        return _cmd_fuzz_user(args, out)
    for flag in ("from_", "to", "src", "dst"):
        if getattr(args, flag) is not None:
            raise WsbError(f"--{flag.rstrip('_')} is for fuzzing your own function: give "
                           "--splitter, --resharder or --converter")
    if args.find_smallest:
        apply_deadline(args.deadline, args.phase == "1b")
        for name in args.find_smallest:
            failure = find_smallest(name, profile=args.profile, phase=args.phase,
                                    forward=phase_forward(args.phase))
            out.text(f"{name}: {failure}")
            out.record("smallest", mutation=name, case=str(failure.outcome.case),
                       message=str(failure))
        out.summary(EXIT_OK, **{**dict.fromkeys(FUZZ_SUMMARY), "found": len(args.find_smallest)})
        return EXIT_OK

    budget = ({"examples": args.examples} if args.examples is not None
              else {"minutes": args.minutes if args.minutes is not None else 1.0})
    work = None
    if args.moe:
        from weight_sync_bench.fuzz.runner import moe_targets

        if args.mutation or args.phase != "1a":
            raise WsbError("--moe runs every MoE property in process: drop --mutation (or "
                           "name MoE mutations with --mutation alone) and --phase")
        work = moe_targets()
    report = _run_fuzz(args, out, mutations=args.mutation, invariant=not args.mutation,
                       chunk=args.chunk, work=work, **budget)
    summary, line = _write_summary(report, args, "fuzz", budget)
    return _finish(report, out, failed=bool(report.failures), matrix=False, extra=[line],
                   summary=summary)


def _range(text: str) -> int | tuple[int, int]:
    """``"1-8"`` -> ``(1, 8)``; ``"4"`` -> ``4``."""
    lo, sep, hi = text.partition("-")
    try:
        return (int(lo), int(hi)) if sep else int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI, got {text!r}") from None


def _domain_field(text: str) -> tuple[str, int | tuple[int, int]]:
    """``"d_model=8-32"`` -> ``("d_model", (8, 32))``."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected FIELD=N or FIELD=LO-HI, got {text!r}")
    return name, _range(value)


def _cmd_fuzz_user(args: argparse.Namespace, out: Output) -> int:
    """``wsb fuzz --splitter | --resharder | --converter mod:fn``: the user's function over
    the (narrowed) fuzz domain, on the same runner, profiles and budgets as ``wsb fuzz``."""
    from weight_sync_bench.fuzz.strategies.user import narrow
    from weight_sync_bench.fuzz.user import UserFunction, UserStats, fuzz_run, user_report

    role = next(r for r in ("splitter", "resharder", "converter") if getattr(args, r))
    spec = getattr(args, role)
    if args.find_smallest or args.mutation:
        raise WsbError(f"--{role} fuzzes your function; --find-smallest and --mutation are the "
                       "harness's own mutations")
    conventions, src, dst = None, args.src, args.dst
    if role == "converter":
        if args.from_ is None or args.to is None:
            raise WsbError("--converter needs --from CONVENTION[:T] and --to CONVENTION[:T]")
        if args.src is not None or args.dst is not None:
            raise WsbError("a converter's degrees are its conventions': --from megatron:4, "
                           "not --src")
        if args.phase != "1a":
            raise WsbError("conversions are fuzzed in process: --phase 1a")
        from weight_sync_bench.fuzz.case import parse_end  # as testing.convert_property reads them

        (src_name, src), (dst_name, dst) = parse_end(args.from_), parse_end(args.to)
        conventions = (src_name, dst_name)
    elif args.from_ is not None or args.to is not None:
        raise WsbError(f"--from / --to name a converter's conventions; a {role} speaks the "
                       "harness's own names (--src / --dst fix its degrees)")
    if role == "splitter" and src is not None:
        raise WsbError("--src has no meaning with --splitter (a split starts from the full "
                       "model); give --dst")
    domain = narrow(max_d_model=args.max_d_model, kv_heads=args.kv_heads,
                    gqa=False if args.no_gqa else True if args.gqa_only else None,
                    vocab_multiple=args.vocab_multiple, **dict(args.domain or []))
    function = UserFunction(load_function(spec, role), role,
                            src=conventions[0] if conventions else None,
                            dst=conventions[1] if conventions else None, name=spec)
    domain = function.domain(domain)  # FP8_DOMAIN for an FP8 destination
    stats = UserStats()
    run = fuzz_run(function, domain=domain, src=src, dst=dst, stats=stats,
                   real=not args.no_real_geometries, phase=args.phase)
    budget = ({"examples": args.examples} if args.examples is not None
              else {"minutes": args.minutes if args.minutes is not None else 1.0})
    report = user_report(_run_fuzz(args, out, work=[(function.prop, function.label)], run=run,
                                   chunk=args.chunk, corpus_path=user_corpus_dir(), **budget),
                         stats)
    out.record("user_function", role=role, function=spec, domain=str(domain),
               checked=stats.checked, declined=stats.declined,
               smallest_declined=(str(stats.smallest_declined.case)
                                  if stats.smallest_declined else None),
               first_failure_at=stats.first_failure_at)
    summary, line = _write_summary(report, args, "fuzz", budget)
    return _finish(report, out, failed=bool(report.failures), matrix=False,
                   extra=["", f"domain: {domain}", *stats.lines(), line], summary=summary)


def cmd_mutants(args: argparse.Namespace) -> int:
    out = Output(args)
    report = _run_fuzz(args, out, examples=args.examples, invariant=False, chunk=args.chunk,
                       mutations=args.mutation)
    survivors = [t.mutation for t in report.tallies if t.killed < t.examples - t.identity]
    extra = ([f"\nnot killed everywhere by 10x: {', '.join(map(str, survivors))}"]
             if survivors else [])
    summary, line = _write_summary(report, args, "mutants", {"examples": args.examples})
    return _finish(report, out, failed=bool(survivors or report.failures), matrix=True,
                   extra=[*extra, line], summary=summary)




def cmd_replay(args: argparse.Namespace) -> int:
    from weight_sync_bench.fuzz.corpus import GIB, ReplayLimits, format_replay, scan_corpus
    from weight_sync_bench.fuzz.replay import replay

    out = Output(args)
    limits = ReplayLimits(max_bytes=int(args.max_gib * GIB), max_flops=args.max_gflop * 1e9)
    scan = scan_corpus([Path(p) for p in args.paths] if args.paths else None, limits)
    for bad in scan.bad:
        out.record("bad_entry", entry=bad.path, field=bad.field, type=type(bad).__name__,
                   message=str(bad))
    phases = sorted({e.case.phase for e in scan.entries})
    apply_deadline(args.deadline, "1b" in phases or not scan.entries)
    results, faults = [], []
    line = out.progress()
    done = 0
    try:
        for phase in phases:  # each phase through its own forward
            forward = phase_forward(phase)
            for entry in (e for e in scan.entries if e.case.phase == phase):
                done += 1
                line.show(f"replay {done}/{len(scan.entries)}: {entry.path.name} (phase {phase})")
                try:
                    (result,) = replay([entry], forward=forward, load=load_function)
                except RankFailure as exc:  # a harness fault, not the entry's verdict
                    faults.append((entry, exc))
                    out.record("harness_fault", property=None, entry=str(entry.path),
                               type=type(exc).__name__, rank=exc.rank, how=None,
                               breadcrumb=exc.breadcrumb, case=None,
                               message=str(exc).splitlines()[0])
                    continue
                results.append(result)
                out.record("replay", **replay_record(result))
    finally:
        line.close()
    if results:
        out.text(format_replay(results))
    for entry, exc in faults:
        out.text(f"\nHARNESS FAULT replaying {entry.path}: {type(exc).__name__}: "
                 f"{str(exc).splitlines()[0]}")
    for bad in scan.bad:
        out.text(f"\nBAD ENTRY {bad.path} (field {bad.field or '-'}): {bad}")
    statuses = [r.status for r in results]
    counts = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
    broken = [r for r in results if not r.claim_holds]
    out.text("\n" + (", ".join(f"{n} {s}" for s, n in counts.items()) or "nothing replayed")
             + f"; the project's claim holds on {len(results) - len(broken)}/{len(results)}"
             + (f"; phases {', '.join(phases)}" if len(phases) > 1 else "")
             + (f"; {len(scan.bad)} bad entr{'y' if len(scan.bad) == 1 else 'ies'}"
                if scan.bad else "")
             + (f"; {len(faults)} harness faults" if faults else ""))
    origins = {o: [r for r in results if r.entry.origin == o] for o in ("discovered", "seeded")}
    if results:
        out.text("; ".join(f"{o}: {len(rs)} (claim holds on {sum(r.claim_holds for r in rs)})"
                           for o, rs in origins.items()))
    if broken:
        code = EXIT_FAILED
    elif faults:
        code = EXIT_HARNESS
    elif scan.bad or not results:
        code = EXIT_USAGE
        if not results and not scan.bad:
            out.text("no corpus entries to replay: nothing was checked")
    else:
        code = EXIT_OK
    out.summary(code, replayed=len(results), broken=len(broken), bad=len(scan.bad),
                harness_faults=len(faults), phases=phases, statuses=counts,
                origins={o: len(rs) for o, rs in origins.items()})
    return code


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``fuzz``, ``mutants`` and ``replay`` to ``wsb`` (``wsb floor``: ``cli.floor``)."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--phase", choices=PHASES, default="1a",
                       help="1a: every rank in this process (the default); 1b: one process "
                            "per rank over gloo")
        p.add_argument("--profile", default=None,
                       help="wsb-test, wsb-nightly, wsb-replay, wsb-generate (default: "
                            "$WSB_PROFILE, else wsb-test)")
        p.add_argument("--seed", type=seed, default=None,
                       help="master seed, 0..2^63-1 (default: random)")
        p.add_argument("--chunk", type=count, default=25, help="Hypothesis examples per property per round")
        p.add_argument("--mutation", action="append", default=None, metavar="NAME",
                       choices=list(MUTATIONS) + list(CONVERSION_MUTATIONS),
                       help="only this mutation (repeatable): a layout mutation ("
                            + ", ".join(MUTATIONS) + "), or a conversion mutation between "
                            "conventions (" + ", ".join(CONVERSION_MUTATIONS) + ")")
        p.add_argument("--summary", type=Path, default=None, metavar="PATH",
                       help="write the campaign summary (JSON: examples, failures, worst "
                            "invariant ratio, smallest kill ratios, seed, commit) here "
                            "(default: <WSB_FUZZ_DIR or .hypothesis>/summaries/)")
        add_output_options(p)
        add_deadline_option(p)

    fuzz = subparsers.add_parser("fuzz", help="fuzz the harness's properties, or your own "
                                 "splitter, resharder or converter; counterexamples are shrunk "
                                 "and saved to a corpus")
    budget = fuzz.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=positive, default=None,
                        help="time budget, a finite number > 0 (default 1)")
    budget.add_argument("--examples", type=count, default=None,
                        help="examples per property, at least (an invariant example checks "
                             "every degree pair of its geometry: each pair counts as one)")
    budget.add_argument("--find-smallest", action="append", choices=list(MUTATIONS),
                        metavar="MUTATION", help="shrink the invariant's failure under this "
                        "mutation to its smallest geometry and write it to corpus/")
    fuzz.add_argument("--moe", action="store_true",
                      help="only the Mixture-of-Experts properties: moe_convert (the harness's "
                           "converter between MoE endpoints) and every MoE mutation's "
                           "moe_convert_kill; the summary counts their near ties")
    common(fuzz)
    own = fuzz.add_argument_group(
        "your own function", "fuzz your splitter, resharder or converter instead of the "
        "harness's reshard; it gets config= (and a converter hf_config=) when its signature "
        "accepts them, and may raise weight_sync_bench.Unsupported to decline a case")
    which = own.add_mutually_exclusive_group()
    which.add_argument("--splitter", metavar="MODULE:FUNCTION",
                       help="fn(full_params, degree) -> shards, against the declared layout")
    which.add_argument("--resharder", metavar="MODULE:FUNCTION",
                       help="fn(shards_at_src, dst) -> shards_at_dst")
    which.add_argument("--converter", metavar="MODULE:FUNCTION",
                       help="fn(shards, degree): --from's shards -> --to's")
    own.add_argument("--from", dest="from_", metavar="CONVENTION[:T]", default=None,
                     help="a converter's source convention (megatron, vllm, hf, meta, plain); "
                          "the degree drawn unless given (and Megatron's pipeline splits, "
                          "where the converter takes source=), or a whole endpoint "
                          "(megatron:tp=2,pp=2)")
    own.add_argument("--to", metavar="CONVENTION[:T]", default=None,
                     help="a converter's destination convention")
    own.add_argument("--src", type=count, default=None, help="fix a resharder's source degree")
    own.add_argument("--dst", type=count, default=None,
                     help="fix a splitter's or resharder's destination degree")
    own.add_argument("--max-d-model", type=count, default=None, metavar="N",
                     help="only geometries with d_model <= N")
    own.add_argument("--kv-heads", type=_range, default=None, metavar="LO-HI",
                     help="only these KV-head counts (inside the fuzz domain's 1-4)")
    gqa = own.add_mutually_exclusive_group()
    gqa.add_argument("--no-gqa", action="store_true", help="MHA only (n_heads == n_kv_heads)")
    gqa.add_argument("--gqa-only", action="store_true", help="GQA only (n_heads >= 2 n_kv_heads)")
    own.add_argument("--vocab-multiple", type=count, default=None, metavar="K",
                     help="only vocabularies that are multiples of K")
    own.add_argument("--domain", type=_domain_field, action="append", default=None,
                     metavar="FIELD=LO-HI", help="narrow any fuzz-domain field (n_kv_heads, "
                     "group, head_dim, d_model, ffn_per_kv_head, vocab_per_kv_head, n_layers, "
                     "batch, seq_len, seed); repeatable")
    own.add_argument("--no-real-geometries", action="store_true",
                     help="do not run the shipped config.json geometries first")
    fuzz.set_defaults(func=cmd_fuzz)

    mutants = subparsers.add_parser("mutants", help="the mutation kill matrix")
    mutants.add_argument("--examples", type=count, default=40,
                         help="examples per mutation")
    common(mutants)
    mutants.set_defaults(func=cmd_mutants)

    replay = subparsers.add_parser("replay", help="re-measure and classify corpus entries")
    replay.add_argument("paths", nargs="*", help="entries or directories (default: every file "
                                                  "in corpus/, each phase through its forward)")
    add_limit_options(replay, max_gib=2.0, max_gflop=50.0, what="an entry")
    add_output_options(replay)
    add_deadline_option(replay)
    replay.set_defaults(func=cmd_replay)
