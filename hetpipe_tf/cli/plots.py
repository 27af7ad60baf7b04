"""Pictures of a run and of a plan, as PNG files (matplotlib, an optional extra).

- :func:`plot_trace`: a Gantt chart of a pipeline trace (the Chrome/Perfetto JSON that
  :class:`hetpipe_tf.pipeline.trace.TraceRecorder` writes): one row per thread of the trace, that
  is per device (stage) of a virtual worker, plus the rows where a stage waits for pulled
  weights under WSP; one colour per instruction kind, time in seconds. Row and group
  names are the trace's own metadata events; a trace of emulated devices says so in
  its title.
- :func:`plot_plan`: a :class:`hetpipe_tf.planning.planner.Plan`, one row of panels per virtual
  worker: each stage's predicted time (forward, backward, receive, apply) labelled with
  its device and layer range, and its predicted memory against the device's capacity.

matplotlib is imported when a picture is drawn, never at import; without it the
functions raise :class:`PlottingUnavailableError` naming the command that installs it.
Figures are drawn with the Agg canvas, so no display is needed and the caller's pyplot
backend is left alone.
"""
import json
import os
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hetpipe_tf.errors import HetPipeRunError, HetPipeUsageError

if TYPE_CHECKING:
    from hetpipe_tf.planning.planner import Plan

INSTALL_COMMAND = "pip install 'hetpipe_tf[plot]'"

# Instruction kinds (trace categories) with a fixed colour and a legend label, in legend order;
# other kinds found in a trace get the next colours of OTHER_COLOURS, in order of total time.
KINDS = {
    "Forward": ("forward", "#1f77b4"),
    "Backward": ("backward", "#ff7f0e"),
    "PushUpdate": ("push", "#2ca02c"),
    "PullWeights": ("pull", "#9467bd"),
    "PullWait": ("wait for pulled weights", "#d62728"),
    "MergePulled": ("merge pulled", "#e377c2"),
    "ApplyUpdate": ("apply update", "#8c564b"),
}
OTHER_COLOURS = ("#17becf", "#bcbd22", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94",
                 "#f7b6d2", "#dbdb8d", "#9edae5", "#c7c7c7", "#393b79", "#637939", "#8c6d31", "#843c39")
PLAN_TIMES = {"forward": "#1f77b4", "backward": "#ff7f0e", "receive": "#17becf", "apply": "#8c564b"}
MEMORY_COLOURS = ("#9467bd", "#2ca02c", "#bcbd22", "#e377c2", "#7f7f7f", "#17becf")


class PlottingUnavailableError(HetPipeRunError, ImportError):
    """matplotlib, which draws the pictures, is not installed."""


class TraceFileError(HetPipeUsageError, ValueError):
    """A file that is not a readable pipeline trace."""


def _figure(**kwargs: Any) -> Any:
    """A matplotlib Figure on its own Agg canvas (pyplot's global state is not touched)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # late: optional dependency
        from matplotlib.figure import Figure  # late: optional dependency
    except ImportError as exc:
        raise PlottingUnavailableError(
            f"drawing a PNG needs the package matplotlib, which is not installed; install it with: "
            f"{INSTALL_COMMAND}") from exc
    fig = Figure(layout="constrained", **kwargs)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)


# Traces ----------------------------------------------------------------------------------
def read_trace(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(events, metadata) of a trace file; TraceFileError says what is wrong with it."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise TraceFileError(f"cannot read trace {path!r}: {exc.strerror}; give a file written by "
                             f"hetpipe-train --trace_file or fit(trace_path=...)") from exc
    except ValueError as exc:
        raise TraceFileError(f"{path!r} is not JSON ({exc}); a trace is the Chrome/Perfetto JSON written by "
                             f"hetpipe-train --trace_file or fit(trace_path=...)") from exc
    if isinstance(data, list):
        return data, {}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceFileError(f"{path!r} is JSON but not a trace: a trace is a list of events or an object "
                             f"with 'traceEvents'")
    return data["traceEvents"], data.get("otherData") or {}


def plot_trace(trace_path: str | os.PathLike[str], output_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Draws the trace in `trace_path` as a Gantt chart into the PNG `output_path`: one panel per
    process of the trace (virtual worker), one row per thread (device, or a stage's waits).

    Returns what was drawn: {"rows": row names top to bottom, "kinds": {kind: spans},
    "spans": number of spans, "duration_s": end of the last span, "emulated": bool}.

    Returns:
        What was drawn, as above.

    Raises:
        TraceFileError: the file cannot be read, is not a trace, or holds no spans.
        PlottingUnavailableError: matplotlib is not installed.
    """
    events, meta = read_trace(trace_path)
    processes, threads, order, bars = {}, {}, {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_sort_index":
            order[(e["pid"], e["tid"])] = e["args"]["sort_index"]
        elif e.get("ph") == "X":
            kind = e.get("cat") or e["name"]
            bars.setdefault(((e["pid"], e["tid"]), kind), []).append((e["ts"] / 1e6, e["dur"] / 1e6))
    if not bars:
        raise TraceFileError(f"{trace_path!r} holds no spans (events with ph 'X'): nothing to draw")
    rows = sorted(set(threads) | {row for row, _ in bars}, key=lambda r: (r[0], order.get(r, r[1]), r[1]))
    pids = sorted({pid for pid, _ in rows})
    emulated = "emulation" in meta or any("EMULATED" in name for name in processes.values())
    colours = _kind_colours(bars)
    end = max(start + dur for spans in bars.values() for start, dur in spans)

    per_pid = [[r for r in rows if r[0] == pid] for pid in pids]
    fig = _figure(figsize=(13, 1.5 + 0.45 * len(rows) + 0.35 * len(pids)))
    axes = fig.subplots(len(pids), 1, squeeze=False, sharex=True,
                        gridspec_kw={"height_ratios": [len(r) for r in per_pid]})[:, 0]
    for ax, pid, members in zip(axes, pids, per_pid):
        for i, row in enumerate(members):
            for kind, (_, colour) in colours.items():
                if (row, kind) in bars:
                    ax.broken_barh(bars[(row, kind)], (i - 0.4, 0.8), facecolors=colour, edgecolors="none")
        ax.set_yticks(range(len(members)), [textwrap.fill(threads.get(r, f"thread {r[1]}"), 56) for r in members],
                      fontsize=8)
        ax.set_ylim(len(members) - 0.5, -0.5)
        ax.set_title(processes.get(pid, f"process {pid}"), fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch  # late: optional dependency

    fig.legend(handles=[Patch(color=colour, label=label) for label, colour in colours.values()],
               loc="outside right upper", fontsize=8, title="instruction", title_fontsize=8)
    axes[-1].set_xlim(0, end * 1.01)
    axes[-1].set_xlabel("time since the first stage started (s)")
    title = f"pipeline timeline: {meta.get('hetpipe_tf', os.path.basename(trace_path))}"
    fig.suptitle(title + (", EMULATED devices" if emulated else ""), fontsize=11)
    if "emulation" in meta:
        fig.supxlabel(textwrap.fill(str(meta["emulation"]), 160), fontsize=8, color="#444444")
    _save(fig, output_path)
    return {"rows": [threads.get(row, f"thread {row[1]}") for row in rows],
            "kinds": {kind: sum(len(v) for (_, k), v in bars.items() if k == kind) for kind in colours},
            "spans": sum(len(v) for v in bars.values()), "duration_s": end, "emulated": emulated}


def _kind_colours(bars: Mapping[tuple[Any, str], Sequence[Any]]) -> dict[str, tuple[str, str]]:
    """{kind: (legend label, colour)}: the KINDS found, in their order, then the others by total time."""
    total = {}
    for (_, kind), spans in bars.items():
        total[kind] = total.get(kind, 0.0) + sum(dur for _, dur in spans)
    colours = {k: KINDS[k] for k in KINDS if k in total}
    others = sorted((k for k in total if k not in KINDS), key=lambda k: -total[k])
    for i, kind in enumerate(others):
        colours[kind] = (kind, OTHER_COLOURS[i % len(OTHER_COLOURS)])
    return colours


# Plans -----------------------------------------------------------------------------------
def plot_plan(plan: "Plan", output_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Draws a :class:`hetpipe_tf.planning.planner.Plan` into the PNG `output_path`: per virtual worker,
    each stage's predicted time (left) and predicted memory against capacity (right).

    Returns what was drawn: {"workers": number of virtual workers, "stages": stages per
    worker, "over_capacity": [(worker, stage)] whose predicted memory exceeds capacity,
    "titles": each worker's panel title}. With uneven minibatches each worker's title gives its
    own minibatch size, and its images/s count that size.

    Returns:
        What was drawn, as above.

    Raises:
        PlottingUnavailableError: matplotlib is not installed.
    """
    d = plan.to_dict()
    workers = d["virtual_workers"]
    stages = [st for w in workers for st in w["stages"]]
    big = max(st["capacity_bytes"] for st in stages) >= 2 ** 30
    unit, scale = ("GiB", 2 ** 30) if big else ("MiB", 2 ** 20)
    counts = [len(w["stages"]) for w in workers]
    fig = _figure(figsize=(14, 1.9 + sum(0.62 * n + 0.75 for n in counts)))
    axes = fig.subplots(len(workers), 2, squeeze=False, sharex="col",
                        gridspec_kw={"width_ratios": [3, 2], "height_ratios": counts})
    over, titles = [], []
    for i, (w, (time_ax, memory_ax)) in enumerate(zip(workers, axes)):
        titles.append(_time_panel(time_ax, w, d["uneven_minibatches"], legend=i == 0))
        over += [(w["index"], q) for q in _memory_panel(memory_ax, w, unit, scale, legend=i == 0)]
    axes[-1][0].set_xlabel("predicted time per minibatch (ms)")
    axes[-1][1].set_xlabel(f"predicted memory ({unit})")
    axes[0][0].set_xlim(0, max(st["time_ms"]["total"] for st in stages) * 1.15)
    axes[0][1].set_xlim(0, max(max(st["memory_bytes"]["total"], st["capacity_bytes"]) for st in stages) / scale * 1.35)
    axes[0][0].legend(loc="lower left", bbox_to_anchor=(0.0, 1.12), ncols=len(PLAN_TIMES), fontsize=8)
    axes[0][1].legend(loc="lower left", bbox_to_anchor=(0.0, 1.12), ncols=2, fontsize=7)
    emulated = " (EMULATED devices)" if plan.cluster.emulated else ""
    batch = ("uneven minibatches " + "+".join(str(w["minibatch_size"]) for w in workers)
             if d["uneven_minibatches"] else f"batch {d['batch_size']}")
    fig.suptitle(f"plan: {d['model']}, {batch} on cluster {d['cluster']}{emulated}; policy "
                 f"{d['policy'].upper()} ({d['allocation']}), Nm={d['num_in_flight']}, D={d['staleness_bound']}; "
                 f"predicted {d['predicted_images_per_s']:.1f} images/s", fontsize=11)
    if d["notes"]:
        fig.supxlabel("\n".join(textwrap.fill(f"note: {n}", 170) for n in d["notes"]), fontsize=7,
                      color="#444444", ha="left", x=0.01)
    _save(fig, output_path)
    return {"workers": len(workers), "stages": counts, "over_capacity": over, "titles": titles}


def _time_panel(ax: Any, worker: Mapping[str, Any], uneven: bool, legend: bool) -> str:
    """Stacked bars of each stage's predicted forward, backward, receive and apply time.

    Returns:
        The panel's title.
    """
    stages = worker["stages"]
    left = [0.0] * len(stages)
    for part, colour in PLAN_TIMES.items():
        widths = [st["time_ms"][part] for st in stages]
        ax.barh(range(len(stages)), widths, left=left, color=colour, height=0.6, label=part if legend else None)
        left = [a + b for a, b in zip(left, widths)]
    for q, st in enumerate(stages):
        total = st["time_ms"]["total"]
        ax.text(left[q], q, f" {total:.1f} ms" if total >= 10 else f" {total:.3g} ms", va="center", fontsize=8)
    labels = [f"stage {q}: {st['device']} ({st['device_type']})\nlayers {st['layers'][0]}..{st['layers'][1]}"
              + (f"  {st['layer_names'][0]}..{st['layer_names'][1]}" if st["layer_names"] else "")
              for q, st in enumerate(stages)]
    ax.set_yticks(range(len(stages)), labels, fontsize=8)
    ax.set_ylim(len(stages) - 0.5, -0.5)
    size = worker["minibatch_size"]
    title = (f"virtual worker {worker['index']}: {''.join(worker['device_types'])}, "
             + (f"minibatch {size}, " if uneven else "")
             + f"Max_m={worker['max_num_in_flight']}, predicted "
             f"{worker['predicted_minibatches_per_s'] * size:.1f} images/s")
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)
    return title


def _memory_panel(ax: Any, worker: Mapping[str, Any], unit: str, scale: float, legend: bool) -> list[int]:
    """Stacked bars of each stage's predicted memory by kind, in a box of the device's capacity.

    Returns:
        The stages over capacity (their numbers are red).
    """
    stages = worker["stages"]
    kinds = [k for k in stages[0]["memory_bytes"] if k != "total"]
    left = [0.0] * len(stages)
    for kind, colour in zip(kinds, MEMORY_COLOURS):
        widths = [st["memory_bytes"][kind] / scale for st in stages]
        ax.barh(range(len(stages)), widths, left=left, color=colour, height=0.6, label=kind if legend else None)
        left = [a + b for a, b in zip(left, widths)]
    capacity = [st["capacity_bytes"] / scale for st in stages]
    ax.barh(range(len(stages)), capacity, height=0.8, fill=False, edgecolor="black", linewidth=1.0,
            label="capacity" if legend else None)
    over = [q for q, st in enumerate(stages) if st["memory_bytes"]["total"] > st["capacity_bytes"]]
    for q, st in enumerate(stages):
        ax.text(max(left[q], capacity[q]), q, f" {st['memory_bytes']['total'] / scale:.1f} / {capacity[q]:.1f} {unit}",
                va="center", fontsize=8, color="red" if q in over else "black")
    ax.set_yticks(range(len(stages)), [f"stage {q}" for q in range(len(stages))], fontsize=8)
    ax.set_ylim(len(stages) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    return over
