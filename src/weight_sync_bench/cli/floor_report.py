"""What ``wsb floor`` prints and draws: each kind's table, the figures two measurements of one
kind are compared by, and the random-geometry floor's plot (``plot``: a bench can draw it
too). Returns text; ``cli.floor`` prints it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from weight_sync_bench.errors import WsbError
from weight_sync_bench.tolerance.phase import PLAIN_FORWARD, cell_forward
from weight_sync_bench.tolerance.rules import SAFETY, threshold_from
from weight_sync_bench.tolerance.sampled import SampledRule, kernel_set_figures, rule_from
from weight_sync_bench.tolerance.training import thresholds_from


def aligned(rows: list[list[str]]) -> list[str]:
    """``rows`` (a header first) as lines of left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def phase_table(artifact: dict[str, Any]) -> str:
    """A phase floor's cells (ULP figures, worst, the kernel set that gave it) and threshold."""
    rows = [["cell", "max ULP", "median ULP", "mean ULP", "worst abs", "kernel set"]]
    for cell in artifact["cells"]:
        which = "" if cell_forward(cell) == PLAIN_FORWARD else f" ({cell_forward(cell)})"
        rows.append([f"{cell['config']}, t={cell['degree']}{which}", f"{cell['max_ulp']:.2f}",
                     f"{cell['median_ulp']:.3f}", f"{cell['mean_ulp']:.3f}",
                     f"{cell['worst_abs']:.4g}",
                     cell.get("kernel_set", artifact["environment"].get("cpu_capability", "?"))])
    lines = aligned(rows)
    lines.append(f"phase {artifact['phase']}: worst {artifact['worst_abs']:.4g}, "
                 f"threshold {threshold_from(artifact):g} ({artifact['rule']})")
    return "\n".join(lines)


def training_table(artifact: dict[str, Any]) -> str:
    """A training (or sequence) floor's worst per regime and quantity, and its threshold."""
    rows = [["regime", "quantity", "worst", "threshold", "ratio", "where"]]
    for regime, per in artifact["regimes"].items():
        for q, w in per.items():
            rows.append([regime, q, f"{w['worst']:.3g}", f"{w['threshold']:g}",
                         f"{w['worst'] / w['threshold']:.2g}x",
                         f"{w['case']} {w['where']}".strip()])
    return "\n".join(aligned(rows))


def rules_table(artifact: dict[str, Any]) -> str:
    """A random-geometry floor's candidate rules' figures, the chosen one marked."""
    rows = [["rule", "threshold", "false positives", "min headroom", "min kill ratio",
             "held-out FP", "held-out headroom", ""]]
    held = {h["rule"]: h for h in artifact.get("holdout", [])}
    for f in artifact["rules"]:
        rule = SampledRule(f["rule"], f["kind"], f["value"])
        h = held.get(f["rule"])
        rows.append([f["rule"], str(rule).split(": ", 1)[1], str(f["false_positives"]),
                     f"{f['min_headroom']:.0f}x", f"{f['min_kill_ratio']:.0f}x",
                     f"{h['false_positives']}/{h['samples']}" if h else "-",
                     f"{h['min_headroom']:.0f}x" if h else "-",
                     "chosen" if f["rule"] == artifact["chosen"] else ""])
    lines = aligned(rows)
    geometries = {tuple(sorted(s["geometry"].items())) for s in artifact["samples"]}
    lines.append(f"{len(artifact['samples'])} floor samples over {len(geometries)} geometries "
                 f"(phase {artifact['phase']})")
    return "\n".join(lines)


def kernel_sets_table(artifact: dict[str, Any]) -> str:
    """``tolerance.sampled.kernel_set_figures`` as an aligned table."""
    return "\n".join(aligned(kernel_set_figures(artifact)))


def validation_table(artifact: dict[str, Any]) -> str:
    """A replicated-KV validation's figures under the rule it validated."""
    v = artifact["validated"]
    rule = SampledRule(**v["rule"])
    return "\n".join(aligned([
        ["rule", "samples", "false positives", "min headroom", "min kill ratio", "degrees"],
        [str(rule), str(v["samples"]), str(v["false_positives"]), f"{v['min_headroom']:.0f}x",
         f"{v['min_kill_ratio']:.0f}x", ", ".join(map(str, v["degrees"]))]]))


def moe_table(artifact: dict[str, Any]) -> str:
    """An MoE validation's figures under the rule it validated: the floors, the routing
    deviations and near ties, the forwards covered, then each MoE mutation's smallest kill."""
    v = artifact["validated"]
    rule = SampledRule(**v["rule"])
    near = v["near_ties"]
    lines = aligned([
        ["rule", "references", "samples", "false positives", "min headroom", "worst route",
         "route headroom", "near-tied references", "near-tied choices"],
        [str(rule), str(v["references"]), str(v["samples"]), str(v["false_positives"]),
         f"{v['min_headroom']:.0f}x", f"{v['worst_route']:.3g}",
         f"{v['min_route_headroom']:.0f}x", str(near["references"]),
         f"{near['choices']} of {near['of']}"]])
    lines.append("forwards: " + ", ".join(f"{w} ranks {f}" for w, f in v["forwards"])
                 + f"; tokens per sequence: {', '.join(map(str, v['seq_lens']))}")
    rows = [["mutation", "live", "min kill ratio", "at", "drawn for it: live",
             "min kill ratio", "hidden from the forward"]]
    for name, kill in v["kills"].items():
        hidden = v["selection_unchanged"].get(name, 0) + v["unrouted"].get(name, 0)
        rows.append([name, str(kill["live"]), f"{kill['min_ratio']:.3g}x",
                     f"{kill['at']} (d_model {kill['d_model']})", str(kill["drawn_live"]),
                     f"{kill['drawn_min_ratio']:.3g}x" if kill["drawn_live"] else "-",
                     str(hidden)])
    return "\n".join(lines + [""] + aligned(rows))


def figures(kind: str, artifact: dict[str, Any]) -> list[tuple[str, str]]:
    """The numbers a reader compares between two measurements of one kind: the sample
    and the thresholds (or rule) it implies, re-derived from the record."""
    try:
        if kind in ("random", "replicated-kv", "moe"):
            rows = [("geometries", f"{artifact.get('geometries', '?')} (+"
                                   f"{artifact.get('searched', 0)} searched of "
                                   f"{artifact.get('search_examples', 0)})"),
                    ("samples", str(len(artifact.get("samples", []))))]
            if kind == "random":
                return rows + [("rule", str(rule_from(artifact)).split(": ", 1)[-1]
                                + f" ({artifact.get('chosen')})")]
            v = artifact["validated"]
            rows += [("false positives", str(v["false_positives"])),
                     ("min headroom", f"{v['min_headroom']:.0f}x")]
            if kind == "moe":
                rows += [("route headroom", f"{v['min_route_headroom']:.0f}x"),
                         ("min kill ratio", f"{v['min_kill_ratio']:.3g}x"),
                         ("min kill ratio, drawn for it", f"{v['min_drawn_kill_ratio']:.3g}x")]
            return rows
        rows = [("repetitions", str(artifact.get("repetitions", "?")))]
        if kind in ("phase", "geometry"):
            return rows + [("cells", str(len(artifact["cells"]))),
                           ("worst |error|", f"{artifact['worst_abs']:.4g}"),
                           ("threshold", f"{threshold_from(artifact):g}")]
        rows += [("steps", str(artifact.get("steps", "?"))),
                 ("cells", str(len(artifact["cells"])))]
        for regime in artifact["regimes"]:
            rows += [(f"{regime} {q}", f"{t:g}")
                     for q, t in thresholds_from(artifact, regime).items()]
        return rows
    except (KeyError, TypeError, ValueError, WsbError) as exc:
        return [("unreadable", f"{type(exc).__name__}: {exc}")]


def compared(kind: str, old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``figures`` of the artifact replaced and of the new one, row by row."""
    before, after = dict(figures(kind, old)), dict(figures(kind, new))
    return [(name, before.get(name, "-"), after.get(name, "-"))
            for name in dict.fromkeys([*after, *before])]


def plot(artifact: dict[str, Any], path: Path) -> None:
    """Floor (and floor / max |reference logit|) against d_model, coloured by depth, with the
    chosen rule's threshold; written atomically as a PNG beside the artifact."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [s for s in artifact["samples"] if s["floor"] > 0]
    d = [s["geometry"]["d_model"] for s in samples]
    depth = [s["geometry"]["n_layers"] for s in samples]
    rule = rule_from(artifact)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, values, label in (
            (axes[0], [s["floor"] for s in samples], "floor: max |sharded - reference| logit"),
            (axes[1], [s["floor"] / s["scale"] for s in samples], "floor / max |reference logit|")):
        points = ax.scatter(d, values, c=depth, cmap="viridis", s=14)
        ax.set_xlabel("d_model")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.colorbar(points, ax=axes[1], label="n_layers")
    if rule.kind == "relative":
        axes[1].axhline(rule.value, color="red", label=f"threshold {rule.value:.2g} x max|ref|")
        axes[1].axhline(rule.value / SAFETY, color="red", ls=":", label=f"threshold / {SAFETY}")
        axes[1].legend(loc="lower right", fontsize=8)
    else:
        axes[0].axhline(rule.value, color="red", label=f"threshold {rule.value:g}")
        axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"phase {artifact['phase']} floor over {len(samples)} samples with t > 1; "
                 f"rule {rule}")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")  # concurrent runs never clash
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
