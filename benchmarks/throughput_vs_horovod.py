"""Allocation policies against Horovod (HetPipe Fig. 4), multi-process, on the same EMULATED devices.

The comparison's 4-type cluster at this machine's scale (:mod:`benchmarks.comparison`): one emulated
device of each of the types V, R, Q, G (speeds 1, 0.67, 0.33, 0.4; memories 12, 24, 8 and 6
MiB), each a node of its own. Measured side by side in one run, D = 0, Nm chosen per policy as
the paper does (§8.2: "Nm is set such that performance is maximized"): each policy runs at the
planner's Nm and at every ``--nm_candidates`` value its workers' memory admits (a row says
when one does not), and its figure is its fastest row. The planner's own choice is in its row:
it charges nothing for a wave's push and merge beyond moving the bytes, which between
processes cost RPCs (tens of ms a wave here), so it picks the smallest Nm it predicts as fast:

* HetPipe **NP** (each node a virtual worker: four of one device), **ED** (every node gives each
  worker the same devices: one worker of all four), **HD** (nodes in pairs, the pairing whose
  workers are most alike, two devices per worker: two workers) with the default parameter
  placement, and **ED-local** (ED with each stage's layers on its node's server, §8.3). Each
  with ``launch="processes"``: one process per virtual worker (a plan of one worker still runs
  it in a process of its own), a worker and a parameter-server task per node.
* **Horovod** (``horovodrun --gloo``, one rank per device; a device too small for the whole
  model is left out, the leave-out rule) and TensorFlow's **MultiWorkerMirroredStrategy**.

Same devices (the time rule of :mod:`hetpipe_tf.pipeline.emulation`, one profile, one
dilation: the NP run, first, calibrates the dilation unless ``--dilation`` gives it, and measures
the profile every system's references come from unless ``--profile`` gives it, see
:mod:`benchmarks.comparison`), same minibatch of 32
per device (per rank; per pipeline slot), same data (the bundled digits, 44 minibatches an
epoch in every system), plain SGD; communication is not padded. images/s: over the epochs after
the first. JSON lines: a setup line (the machine and its load average at start), one row per
system (its overrun fraction, whether the emulation was faithful), the ratio HetPipe / Horovod
and HetPipe / MWMS per policy and a summary against the target (best policy >= 1.5x
Horovod; the ceiling on these devices is sum(v) / (n x min(v)) = 1.8x).

``--model=gpt`` runs the same comparison on a transformer: hetpipe_tf's ``gpt`` (two GPT-2
blocks, width 64) on hetpipe_addition's sums, 44 minibatches of 32 sequences an epoch in every
system, each row also in tokens/s (sequences/s times the 11 tokens a sequence holds; the
ratios are the same), written to ``throughput_vs_horovod_gpt.jsonl`` and ``.png`` by default.

``--cluster=paper_quota`` runs it with real compute on CPU-quota nodes instead
(:mod:`benchmarks.quota_nodes`): the ``paper_quota`` preset's four node types of two devices,
each node's processes in a CPU-quota group, dilation 1 and nothing padded; every node's speed
measured first, every system's bound from those speeds; HetPipe's policies NP, HD and ED (each
node's worker task in its group, the virtual workers' processes outside: a device computes, its
host runs the runtime), then Horovod (each rank's kernel threads in its device's node's group, its
Python and all-reduce outside) and MWMS (each rank in its group; ``--baselines`` chooses which).
Its JSON lines and plot go to names with a ``_quota`` suffix; its rows say ``"emulated": false``
and their share of their bound.

    python benchmarks/throughput_vs_horovod.py [--model=gpt] [--epochs=4] [--dilation=D] [--nm_candidates=4,8,16]
        [--memory=G=4M] [--beside_in_process] [--out=benchmarks/results/throughput_vs_horovod.jsonl]
        [--png=benchmarks/results/throughput_vs_horovod.png]
    python benchmarks/throughput_vs_horovod.py --cluster=paper_quota [--model=gpt] [--epochs=6] [--nm_candidates=]
        [--baselines=Horovod,MWMS]
"""
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import comparison  # noqa: E402
from benchmarks.baselines.ranks import DATASETS  # noqa: E402

BENCHMARK = "throughput_vs_horovod"
TYPES = "VRQG"
# name, policy, parameter placement, devices per virtual worker (None: the policy's default).
# HD's default (the smallest node's count, 1 here) makes no pairs: two devices per worker.
# NP runs first: it calibrates the dilation and measures the profile every system is emulated from.
POLICIES = (("NP", "np", "default", None), ("HD", "hd", "default", 2), ("ED", "ed", "default", None),
            ("ED-local", "ed", "local", None))
TARGET, CEILING_NOTE = 1.5, "sum(v) / (n x min(v)) of the devices"
#: On CPU-quota nodes: HD's default (pairs of nodes, the node's two devices per worker).
QUOTA_POLICIES = (("NP", "np", "default", None), ("HD", "hd", "default", None), ("ED", "ed", "default", None))
BASELINES = ("Horovod", "MWMS")


def ceiling(types):
    """What an ideal heterogeneous pipeline gains over synchronous data parallelism on `types`:
    sum of speeds over (ranks x the slowest speed)."""
    speeds = [t[1] for t in types]
    return sum(speeds) / (len(speeds) * min(speeds))


def ratios(rows):
    """Per HetPipe row: its images/s over Horovod's and over MWMS's (None where one is missing)."""
    by = {r["system"]: r.get("images_per_s") for r in rows}
    return [{"system": r["system"], "hetpipe_over_horovod": comparison.ratio(r["images_per_s"], by.get("Horovod")),
             "hetpipe_over_mwms": comparison.ratio(r["images_per_s"], by.get("MWMS"))}
            for r in rows if r["system"].startswith("HetPipe") and r.get("images_per_s")]


def nm_candidates(text):
    """--nm_candidates='4,8' as (4, 8)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = (0,)
    if any(v < 1 for v in values):
        raise ValueError(f"--nm_candidates={text!r}: give whole numbers >= 1 separated by commas, e.g. 4,8, "
                         f"or '' for the planner's Nm only")
    return values


def best_by_policy(rows):
    """Per policy (rows in processes): its fastest row's Nm, images/s and the Nm the planner chose."""
    out = {}
    for r in rows:
        if r.get("launch", "processes") != "processes" or not r.get("images_per_s") or "policy_name" not in r:
            continue
        best = out.get(r["policy_name"])
        if best is None or r["images_per_s"] > best["images_per_s"]:
            out[r["policy_name"]] = {"num_in_flight": r["num_in_flight"], "images_per_s": r["images_per_s"],
                                     "system": r["system"]}
    for r in rows:
        if r.get("planner_nm") and r.get("policy_name") in out:
            out[r["policy_name"]]["planner_num_in_flight"] = r["num_in_flight"]
    return out


def summary(rows, types):
    """The best HetPipe policy in processes against Horovod, the target and the ceiling
    (rows run in one process stand beside, they do not count)."""
    table = ratios([r for r in rows if r.get("launch", "processes") == "processes"])
    measured = [t for t in table if t["hetpipe_over_horovod"] is not None]
    best = max(measured, key=lambda t: t["hetpipe_over_horovod"], default=None)
    ratio = best["hetpipe_over_horovod"] if best else None
    horovod = next((r["images_per_s"] for r in rows if r["system"] == "Horovod" and r.get("images_per_s")), None)
    by_policy = {name: {**b, "hetpipe_over_horovod": comparison.ratio(b["images_per_s"], horovod)}
                 for name, b in best_by_policy(rows).items()}
    return {"summary": True, "best_policy": best["system"] if best else None, "best_over_horovod": ratio,
            "best_by_policy": by_policy,
            "target": TARGET, "target_met": bool(ratio is not None and ratio >= TARGET),
            "short_of_target_by": None if ratio is None else round(max(0.0, TARGET - ratio), 3),
            "ceiling": round(ceiling(types), 3), "ceiling_is": CEILING_NOTE, "emulated": True,
            "all_faithful": all(r.get("emulation_faithful", False) for r in rows if "images_per_s" in r)}


def baselines(text):
    """--baselines='Horovod,MWMS' as a tuple of BASELINES' names."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise ValueError(f"--baselines={text!r}: {unknown} unknown; give some of {', '.join(BASELINES)} separated by "
                         f"commas, or '' for none")
    return names


def quota_policies(text):
    """--policies='NP,ED' as those of QUOTA_POLICIES, in its order."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - {p[0] for p in QUOTA_POLICIES})
    if unknown:
        raise ValueError(f"--policies={text!r}: {unknown} unknown; give some of "
                         f"{', '.join(p[0] for p in QUOTA_POLICIES)} separated by commas")
    return tuple(p for p in QUOTA_POLICIES if p[0] in names)


def result_path(path, model, quota):
    """Where a run's --out or --png goes by default: the cnn's name, with _MODEL for another model
    and _quota on CPU-quota nodes (a name given that is not the default is kept)."""
    suffix = ("" if model == "cnn" else f"_{model}") + ("_quota" if quota else "")
    return path.replace(f"/{BENCHMARK}.", f"/{BENCHMARK}{suffix}.")


def quota_main(args, candidates, systems, policies=QUOTA_POLICIES):
    """The comparison on CPU-quota nodes (see the module docstring and :mod:`benchmarks.quota_nodes`)."""
    from benchmarks import quota_nodes
    from benchmarks.baselines.processes import BaselineRunError

    def run(system, *a, **k):  # a failed run is tried once more (a port another process took meanwhile), then a row
        for attempt in (1, 2):
            try:
                return (quota_nodes.baseline_row if system in BASELINES else quota_nodes.hetpipe_row)(system, *a, **k)
            except BaselineRunError as e:
                print(f"{system}: attempt {attempt} failed: {str(e)[:300]}", file=sys.stderr, flush=True)
                failed = quota_nodes.failed_row(system if system in BASELINES else f"HetPipe {system}", e)
        return {**failed, "attempts": 2}

    rows = []
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out, \
            tempfile.TemporaryDirectory(prefix=f"{BENCHMARK}-") as folder:
        profile = os.path.splitext(args.out)[0] + ".profile.json" if args.out else os.path.join(folder, "profile.json")
        comparison.emit(out, BENCHMARK, setup={
            "machine": comparison.machine(), "quiet": quota_nodes.quiet(), "cluster": quota_nodes.CLUSTER,
            "node_quotas": dict(zip((n.name for n in quota_nodes.cluster().nodes), quota_nodes.cluster().node_quotas())),
            "label": quota_nodes.LABEL, "model": args.model, "dataset": DATASETS[args.model],
            "batch_size_per_device": comparison.BATCH_SIZE, "staleness_bound": 0, "epochs": args.epochs,
            "emulated": False, "dilation": 1, "nm_candidates": list(candidates), "baselines": list(systems),
            "policies": [p[0] for p in policies],
            "profile": f"measured with the node speeds before the runs, written to {profile}"})
        speeds = quota_nodes.measure_speeds(args.model, profile, args.seed, args.deadline_s)
        comparison.emit(out, BENCHMARK, **speeds)
        by_type = {t: v["speed"] for t, v in speeds["node_speeds"].items()}
        whole_pass_s = next(iter(speeds["node_speeds"].values()))["free_seconds"]
        for name, policy, placement, vw_size in policies:
            row = run(f"{name} (planner's Nm)", policy, placement, vw_size, args.epochs, profile,
                                          by_type, whole_pass_s, args.deadline_s, args.seed, model=args.model)
            rows.append({**row, "policy_name": name, "planner_nm": True, "quiet": quota_nodes.quiet()})
            comparison.emit(out, BENCHMARK, **rows[-1])
            for nm in (c for c in candidates if c != row.get("num_in_flight")):
                rows.append({**run(f"{name}, Nm={nm}", policy, placement, vw_size, args.epochs,
                                                       profile, by_type, whole_pass_s, args.deadline_s, args.seed,
                                                       num_in_flight=nm, model=args.model),
                             "policy_name": name, "quiet": quota_nodes.quiet()})
                comparison.emit(out, BENCHMARK, **rows[-1])
        for system in systems:
            rows.append({**run(system, args.epochs, whole_pass_s, by_type, args.deadline_s,
                                                    args.seed, args.model), "quiet": quota_nodes.quiet()})
            comparison.emit(out, BENCHMARK, **rows[-1])
        for line in ratios(rows):
            comparison.emit(out, BENCHMARK, **line)
        comparison.emit(out, BENCHMARK, **quota_nodes.summary(rows, speeds), best_by_policy=best_by_policy(rows))
    if args.png:
        quota_plot(rows, by_type, args.model, args.png)


def quota_plot(rows, speeds, model, path):
    """The bars of the rows of a run on CPU-quota nodes (`speeds`: each type's measured speed)."""
    from benchmarks import quota_nodes

    names = "/".join(f"{t} {v:.3f}" for t, v in speeds.items())
    comparison.bar_plot(rows, path, f"{model} on {DATASETS[model]}, D=0: HetPipe policies vs Horovod and MWMS,\n"
                                    f"{quota_nodes.LABEL} (paper_quota: 4 nodes x 2 devices),\n"
                                    f"measured speeds {names}",
                        unit="images/s" if model == "cnn" else "sequences/s", devices=quota_nodes.LABEL)


def main():
    args = comparison.arguments(__doc__, BENCHMARK, "NP", options={"nm_candidates": (
        "4,8,16", "Nm to run each policy at besides the planner's (its figure is its fastest row); '' for the "
        "planner's only"), "model": ("cnn", "cnn (the digits) or gpt (hetpipe_addition's sums)"),
        "cluster": ("", "'' (4 EMULATED devices) or paper_quota (real compute on CPU-quota nodes)"),
        "baselines": (",".join(BASELINES), "on paper_quota: the all-reduce baselines to run, of Horovod,MWMS"),
        "policies": (",".join(p[0] for p in QUOTA_POLICIES), "on paper_quota: the HetPipe policies to run, of NP,HD,ED")},
        beside_in_process=("also ED-local with every stage in one process (launch='in_process'), beside the others"))
    try:
        candidates = nm_candidates(args.nm_candidates)
        systems = baselines(args.baselines)
        policies = quota_policies(args.policies)
    except ValueError as e:
        sys.exit(str(e))
    if args.model not in DATASETS:
        sys.exit(f"--model={args.model!r}: give one of {', '.join(DATASETS)}")
    if args.cluster not in ("", "paper_quota"):
        sys.exit(f"--cluster={args.cluster!r}: give paper_quota (real compute on CPU-quota nodes), or leave it out "
                 f"for the 4 emulated devices")
    quota = args.cluster == "paper_quota"
    for flag in ("out", "png"):  # each its own results beside the cnn's, unless --out/--png name them
        setattr(args, flag, result_path(getattr(args, flag), args.model, quota))
    if quota:
        if args.dilation or args.memory or args.profile or args.beside_in_process:
            sys.exit("--cluster=paper_quota runs real compute on the preset's nodes: --dilation, --memory, --profile "
                     "and --beside_in_process are for the emulated devices; leave them out")
        quota_main(args, candidates, systems, policies)
        return
    types = comparison.device_types(TYPES, args.memory)
    rows = []
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out, \
            tempfile.TemporaryDirectory(prefix=f"{BENCHMARK}-") as folder:
        profile = comparison.run_profile(args, folder)
        comparison.emit(out, BENCHMARK, setup={
            "machine": comparison.machine(), "cluster": comparison.cluster_spec(types), "model": args.model,
            "dataset": DATASETS[args.model], "batch_size_per_device": comparison.BATCH_SIZE, "staleness_bound": 0,
            "epochs": args.epochs, "emulated": True, "nm_candidates": list(candidates),
            "profile": args.profile or f"the first HetPipe run's (NP: measured, or this machine's cached one), written to {profile}",
            "reference": "every system's from the profile (comparison.whole_model_reference_ms for the baselines)",
            "dilation": args.dilation if args.dilation else "calibrated by the first HetPipe run (NP)"})
        dilation = args.dilation
        for name, policy, placement, vw_size in POLICIES:
            row = comparison.hetpipe_row(f"{name} (planner's Nm)", types, policy, placement, dilation, args.epochs,
                                         profile, vw_size, args.deadline_s, args.seed, model=args.model)
            dilation = row["dilation"]
            rows.append({**row, "policy_name": name, "planner_nm": True})
            comparison.emit(out, BENCHMARK, **rows[-1])
            for nm in (c for c in candidates if c != row["num_in_flight"]):
                rows.append({**comparison.hetpipe_row(f"{name}, Nm={nm}", types, policy, placement, dilation,
                                                      args.epochs, profile, vw_size, args.deadline_s, args.seed,
                                                      num_in_flight=nm, model=args.model), "policy_name": name})
                comparison.emit(out, BENCHMARK, **rows[-1])
        if args.beside_in_process:
            rows.append(comparison.hetpipe_row("ED-local in one process (beside)", types, "ed", "local", dilation,
                                               args.epochs, profile, None, args.deadline_s, args.seed, "in_process",
                                               model=args.model))
            comparison.emit(out, BENCHMARK, **rows[-1])
        reference_ms = comparison.whole_model_reference_ms(profile)
        for run in (comparison.horovod_row, comparison.mwms_row):
            rows.append(run(types, dilation, reference_ms, args.epochs, args.deadline_s, args.seed, args.model))
            comparison.emit(out, BENCHMARK, **rows[-1])
        for line in ratios(rows):
            comparison.emit(out, BENCHMARK, **line)
        comparison.emit(out, BENCHMARK, **summary(rows, types))
    if args.png:
        comparison.bar_plot(rows, args.png, f"{args.model} on {DATASETS[args.model]}, D=0: HetPipe policies vs "
                                            f"Horovod and MWMS, 4 EMULATED devices V/R/Q/G (speeds 1/0.67/0.33/0.4), "
                                            f"dilation {dilation:g}",
                            unit="images/s" if args.model == "cnn" else "sequences/s")


if __name__ == "__main__":
    main()
