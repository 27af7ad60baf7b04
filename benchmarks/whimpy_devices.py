"""Adding whimpy devices (HetPipe Table 4), multi-process, on the same EMULATED devices.

The paper adds GPU types one at a time, 4[V], 4[VR], 4[VRQ], 4[VRQG], and compares HetPipe
ED-local with Horovod. At this machine's scale (2 cores) each type is ONE emulated device, a
node of its own (:mod:`benchmarks.comparison`: V, R, Q, G of speeds 1, 0.67, 0.33, 0.4 and
12, 24, 8, 6 MiB), so the rows have 1, 2, 3 and 4 devices: HetPipe ED-local is then one
virtual worker pipelined over every device (ED gives each worker one device of each node), with
the planner's cut and Nm, D = 0, in a process of its own (``launch="processes"``); Horovod
(``horovodrun --gloo``) has one rank per device, leaving out any device that cannot hold the
whole model (the leave-out rule: Table 4's X; ``--memory=G=4M`` makes G one).

Per row: HetPipe's images/s and total number of concurrent minibatches (Nm x virtual workers),
Horovod's images/s, ranks and the devices it left out, the ratio HetPipe / Horovod, and each
system's images/s over its own V row (what adding the whimpy devices bought). All rows of a run
share one dilation (the VRQG HetPipe run, the most loaded, calibrates it unless ``--dilation``
gives it) and one profile, which every system's references come from (the VRQG run measures it
unless ``--profile`` gives it; :mod:`benchmarks.comparison`); each row reports its overrun
fraction, whether the emulation was faithful, and the share of its references' bound it reached.

    python benchmarks/whimpy_devices.py [--epochs=4] [--dilation=D] [--memory=G=4M]
        [--out=benchmarks/results/whimpy_devices.jsonl] [--png=benchmarks/results/whimpy_devices.png]
"""
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import comparison  # noqa: E402

BENCHMARK = "whimpy_devices"
ROWS = ("V", "VR", "VRQ", "VRQG")


def table(hetpipe, horovod):
    """Table 4's rows from {types: HetPipe row} and {types: Horovod row}: images/s of both, the
    concurrent minibatches, Horovod's left-out devices, the ratio and the gains over the V row."""
    out = []
    for types in ROWS:
        h, b = hetpipe.get(types), horovod.get(types)
        if h is None:
            continue
        row = {"types": types, "devices": len(types), "hetpipe_images_per_s": h["images_per_s"],
               "concurrent_minibatches": h["concurrent_minibatches"], "num_in_flight": h["num_in_flight"],
               "virtual_workers": len(h["virtual_workers"]),
               "horovod_images_per_s": b.get("images_per_s") if b else None,
               "horovod_ranks": b.get("ranks") if b else None,
               "horovod_left_out": b.get("left_out") if b else None,
               "hetpipe_over_horovod": comparison.ratio(h["images_per_s"], b and b.get("images_per_s")),
               "hetpipe_gain_over_V": comparison.ratio(h["images_per_s"], hetpipe.get("V", {}).get("images_per_s")),
               "horovod_gain_over_V": comparison.ratio(b and b.get("images_per_s"),
                                                       (horovod.get("V") or {}).get("images_per_s")),
               "all_faithful": h["emulation_faithful"] and bool(b and b.get("emulation_faithful")),
               "emulated": True}
        out.append(row)
    return out


def main():
    args = comparison.arguments(__doc__, BENCHMARK, "VRQG")
    hetpipe, horovod = {}, {}
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out, \
            tempfile.TemporaryDirectory(prefix=f"{BENCHMARK}-") as folder:
        profile = comparison.run_profile(args, folder)
        comparison.emit(out, BENCHMARK, setup={
            "machine": comparison.machine(),
            "devices": comparison.cluster_spec(comparison.device_types("VRQG", args.memory)),
            "one_device_per_type": "2 cores: one emulated device of each type, not the paper's four",
            "model": "cnn", "dataset": "hetpipe_digits", "batch_size_per_device": comparison.BATCH_SIZE,
            "staleness_bound": 0, "epochs": args.epochs, "emulated": True,
            "profile": args.profile or f"the first HetPipe run's (VRQG: measured, or this machine's cached one), written to {profile}",
            "reference": "every system's from the profile (comparison.whole_model_reference_ms for the baselines)",
            "dilation": args.dilation if args.dilation else "calibrated by the VRQG HetPipe run"})
        dilation = args.dilation
        for types in reversed(ROWS):
            row = comparison.hetpipe_row(f"ED-local {types}", comparison.device_types(types, args.memory), "ed",
                                         "local", dilation, args.epochs, profile, None, args.deadline_s, args.seed)
            dilation = row["dilation"]
            hetpipe[types] = row
            comparison.emit(out, BENCHMARK, types=types, **row)
        reference_ms = comparison.whole_model_reference_ms(profile)
        for types in ROWS:
            horovod[types] = comparison.horovod_row(comparison.device_types(types, args.memory), dilation, reference_ms,
                                                    args.epochs, args.deadline_s, args.seed)
            comparison.emit(out, BENCHMARK, types=types, **horovod[types])
        rows = table(hetpipe, horovod)
        for row in rows:
            comparison.emit(out, BENCHMARK, table_4=True, **row)
    if args.png:
        bars = [dict(r, system=f"{kind} {t}") for t in ROWS for kind, r in (("HetPipe", hetpipe[t]),
                                                                          ("Horovod", horovod[t]))]
        comparison.bar_plot(bars, args.png, f"cnn on digits, D=0: HetPipe ED-local vs Horovod as device types are "
                                            f"added, one EMULATED device per type, dilation {dilation:g}")


if __name__ == "__main__":
    main()
