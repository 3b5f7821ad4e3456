"""
How the benchmarks report what support/benchmark.py measured.

    markdown_table                       a markdown table, as every tool writes one
    headline, highlights_table           the README's table, bench.md's
    best_mdm, fastest_close, most_accurate, first_quality
                                         which points a table picks
    throughput_table, compiled_table     batched and compiled decoding, as markdown
    plot                                 quality against tokens/s, per task (matplotlib)
    write_json_and_md, write_report      a run's JSON and markdown; bench.json, .md and .png
"""

import json
import os

from support.drawing import pyplot
from support.files import write_atomic


def best_mdm(rows):
    """The MDM point "vs MDM" compares with: the most accurate MDM row, the fastest of those that
    tie; None without one."""
    return max((r for r in rows if r["method"] == "mdm"),
               key=lambda r: (first_quality(r), r["tokens_per_s"]), default=None)


def fastest_close(points, ar_quality):
    """The fastest of the points within 1 point of the ARM's quality; None when none is, or when
    the ARM got nothing right."""
    if ar_quality <= 0:
        return None
    close = [r for r in points if first_quality(r) >= ar_quality - 0.01]
    return max(close, key=lambda r: r["tokens_per_s"]) if close else None


def most_accurate(points):
    """The point of the best quality, the fastest of those that tie."""
    return max(points, key=lambda r: (first_quality(r), r["tokens_per_s"]))


def headline(rows):
    """The README's table, as markdown: per task the ARM, best_mdm, and per decoding_mode the
    ReFusion point fastest_close picks (else most_accurate). rows: bench.json's points, the ARM's
    first in each task."""
    cells = []
    for task in dict.fromkeys(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == task]
        ar_quality = first_quality(task_rows[0])
        picks = [task_rows[0]] + [r for r in [best_mdm(task_rows)] if r is not None]
        refusion = [r for r in task_rows if r["method"] == "refusion"]
        for mode in dict.fromkeys(decoding_mode(r["settings"]) for r in refusion):
            points = [r for r in refusion if decoding_mode(r["settings"]) == mode]
            picks.append(fastest_close(points, ar_quality) or most_accurate(points))
        cells += [[task, r["label"], quality_text(r), r["tokens"], f"{r['tpf']:.2f}",
                  f"{r['tokens_per_s']:.0f}", f"{r['speedup_vs_ar']:.2f}x",
                  speedup_text(r.get("speedup_vs_mdm"), 1)] for r in picks]
    header = ["task", "decoder", "quality", "tokens", "TPF", "tokens/s", "vs ARM", "vs MDM"]
    return markdown_table(header, cells)


def decoding_mode(settings):
    """A ReFusion point's mode, from its settings: "exact" (verify="exact", SPEC 4.5), else its
    infill ("paper" or "speculative", SPEC 4.1)."""
    return "exact" if settings.get("verify") == "exact" else settings["infill"]


# how a table or plot names each decoding_mode
MODE_NAMES = {"paper": "paper infill", "speculative": "infill=speculative",
              "exact": "verify=exact"}


def first_quality(row):
    """A point's quality measure: the first metric of its task (exact, accuracy or parse_rate)."""
    return next(iter(row["quality"].values()))


def speedup_text(ratio, digits=2):
    """A speed-up as a table shows it ("4.29x"), or "-" where there is nothing to compare with."""
    return "-" if ratio is None else f"{ratio:.{digits}f}x"


def quality_text(row):
    """A point's quality metrics as text: "parse_rate 83.9%, first_line 1.1%"."""
    return ", ".join(f"{m} {q:.1%}" for m, q in row["quality"].items())


def markdown_table(header, rows, right=()):
    """A markdown table of header (column names) and rows (lists of cells, written with str);
    right: the indices of the columns aligned right."""
    rule = ["---:" if i in right else "---" for i in range(len(header))]
    lines = [header, rule] + [list(map(str, row)) for row in rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def highlights_table(rows):
    """The highlighted rows as a markdown table."""
    header = ["task", "decoder", "why", "train iters", "quality", "tokens", "NFE", "TPF",
              "tokens/s", "ms/forward", "bookkeeping", "vs ARM", "vs MDM"]
    cells = [[r["task"], r["label"], r["why"], r["train_iters"], quality_text(r), r["tokens"],
              r["nfe"], f"{r['tpf']:.2f}", f"{r['tokens_per_s']:.0f}",
              f"{r['ms_per_forward']:.2f}", f"{r['bookkeeping_share']:.0%}",
              f"{r['speedup_vs_ar']:.2f}x", speedup_text(r.get("speedup_vs_mdm"), 1)]
             for r in rows]
    return markdown_table(header, cells)


# the plot's series: (colour, marker)
STYLE = {"ARM": ("tab:blue", "s"), "HF generate": ("tab:cyan", "D"), "MDM": ("tab:olive", "v"),
         "MDM-ft (from the ARM)": ("tab:green", "^"),
         "ReFusion, paper infill": ("tab:red", "o"),
         "ReFusion, infill=speculative": ("tab:orange", "o"),
         "ReFusion-ft, paper infill": ("tab:purple", "o"),
         "ReFusion-ft, infill=speculative": ("tab:pink", "o"),
         "ReFusion, verify=exact": ("tab:brown", "P"),
         "ReFusion-ft, verify=exact": ("tab:gray", "P")}


# the small benchmark's models, as its rows name them
NAMES = {"ar": "ARM", "mdm": "MDM", "mdm-ft": "MDM-ft", "refusion": "ReFusion",
         "refusion-ft": "ReFusion-ft"}


def series(row):
    """The plot's series of a point: its "series", else its model and, for ReFusion, its
    decoding_mode."""
    if "series" in row:
        return row["series"]
    if row["method"] == "hf":
        return "HF generate"
    if row["method"] == "refusion":
        return f"{NAMES[row['model']]}, {MODE_NAMES[decoding_mode(row['settings'])]}"
    return "MDM-ft (from the ARM)" if row["model"] == "mdm-ft" else NAMES[row["model"]]


def plot(rows, path):
    """Draw rows as a PNG at path: per task, quality against tokens/s relative to the ARM (log
    scale), a series per model and infill mode, each ReFusion one with its frontier. Returns False
    without matplotlib, else True."""
    try:
        plt = pyplot()
    except ValueError:                                  # no matplotlib
        return False
    task_names = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(task_names), figsize=(6 * len(task_names), 4.5), squeeze=False)
    style = dict(STYLE)
    colors = iter(["tab:brown", "tab:gray", "tab:olive", "tab:cyan", "tab:blue", "tab:red"])
    for r in rows:  # a series the table above does not name gets a colour of its own
        name = series(r)
        if name not in style:
            style[name] = (next(colors, "black"), "o" if r["method"] == "refusion" else "s")

    for ax, task in zip(axes[0], task_names):
        task_rows = [r for r in rows if r["task"] == task]
        for name, (color, marker) in style.items():
            pts = [r for r in task_rows if series(r) == name]
            if not pts:
                continue
            xs, ys = [r["speedup_vs_ar"] for r in pts], [first_quality(r) for r in pts]
            ax.scatter(xs, ys, color=color, marker=marker, label=name, alpha=0.8)
            if pts[0]["method"] == "refusion":
                frontier = sorted((x, y) for x, y in zip(xs, ys)
                                  if not any(x2 >= x and y2 > y or x2 > x and y2 >= y
                                             for x2, y2 in zip(xs, ys)))
                ax.plot(*zip(*frontier), color=color, alpha=0.6)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(plt.LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:g}x"))
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("tokens/s relative to the ARM (log scale)")
        ax.set_ylabel(next(iter(task_rows[0]["quality"])))
        ax.set_title(task)
        ax.legend(fontsize=8)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, dpi=120, format="png"))
    return True


def compiled_table(compiled, task):
    """compiled_vs_eager's result as markdown."""
    header = ["decoder", "eager tokens/s", "compiled tokens/s", "vs eager", "identical to eager",
              "graphs", "compile (s)"]
    rows = [[r["decoder"], f"{r['tokens_per_s']:.0f}", f"{r['compiled_tokens_per_s']:.0f}",
             f"{r['vs_eager']:.2f}x", f"{r['identical']:.0%}", r["graphs"], f"{r['compile_s']:.0f}"]
            for r in compiled["rows"]]
    return (f"Compiled decoding (--compile; {task}, {compiled['n_prompts']} prompts, one at a "
            "time):\n\n" + markdown_table(header, rows))


def throughput_table(rows, task, n_prompts):
    """batch_throughput's rows as markdown, then a line per other decoder: the batch size from which
    the first one (the ARM) is as fast, if measured."""
    first = rows[0]["decoder"]
    header = ["decoder", "batch", "tokens/s", "vs batch 1", f"vs {first}",
              "latency per prompt (ms)", "identical to batch 1"]
    cells = [[r["decoder"], r["batch_size"], f"{r['tokens_per_s']:.0f}", f"{r['vs_batch_1']:.2f}x",
              f"{r['vs_first']:.2f}x", f"{r['latency_ms']:.0f}", f"{r['identical']:.0%}"]
             for r in rows]
    lines = [f"Batched decoding ({task}, {n_prompts} prompts; tokens/s over all of them):", "",
             markdown_table(header, cells), ""]
    for label in dict.fromkeys(r["decoder"] for r in rows if r["decoder"] != first):
        own = [r for r in rows if r["decoder"] == label]
        caught = next((r["batch_size"] for r in own if r["vs_first"] <= 1), None)
        lines.append(f"{first} is at least as fast as {label} from batch {caught} on."
                     if caught else f"{label} is faster than {first} at every batch size "
                     f"measured, up to {own[-1]['batch_size']}.")
    return "\n".join(lines)


def write_json_and_md(out_dir, name, report, markdown):
    """Write out_dir/<name>.json (the dict report, a value JSON has no type for as str) and
    out_dir/<name>.md (markdown), atomically, making out_dir if need be."""
    os.makedirs(out_dir, exist_ok=True)
    write_atomic(os.path.join(out_dir, f"{name}.json"),
                 lambda f: f.write(json.dumps(report, indent=2, default=str).encode()))
    write_atomic(os.path.join(out_dir, f"{name}.md"), lambda f: f.write((markdown + "\n").encode()))


def write_report(out_dir, report, table):
    """Write bench.json (report, its "rows" the points), bench.md (table) and, with matplotlib,
    bench.png (plot) into out_dir; print the table and what was written."""
    write_json_and_md(out_dir, "bench", report, table)
    print("\n" + table)
    if plot(report["rows"], os.path.join(out_dir, "bench.png")):
        print(f"wrote {out_dir}/bench.png")
    print(f"wrote {out_dir}/bench.json and {out_dir}/bench.md")
