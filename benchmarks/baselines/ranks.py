"""The emulated ranks of an all-reduce baseline: their flags, which of them can hold the model,
and the JSON line of a run.

Pure Python (standard library only), so that both venvs load it: the main one (TensorFlow
2.21) and the Horovod one (TensorFlow 2.15, which cannot import hetpipe_tf), which is also why
hetpipe_tf's emulation and model zoo are loaded here by path (:func:`load_source`): one
definition of each, shared with HetPipe.

Time rule (:mod:`hetpipe_tf.pipeline.emulation`): on a rank of relative speed ``v`` the compute
of a step (forward and backward on the rank's minibatch) takes
``max(actual, dilation / v * reference)``; the all-reduce and the update are not padded.
``reference`` is the host's solo compute time of a step (see :mod:`benchmarks.baselines.training`).
``--speeds`` gives each rank's ``v``; ``--slowdowns`` gives each rank's whole factor
``dilation / v`` instead, as the comparison's example states it (3,4.5,7.5,9): the dilation is then
the smallest factor and ``v = dilation / slowdown``. Without either dilation, it is calibrated
(``emulation.calibrate_dilation``).

Memory rule: data parallelism puts the whole model on every rank, which holds its weights,
their gradients (the all-reduce's buffer), the optimizer's slots, the non-trainable state and
the activations of one minibatch (every layer's output, kept for the backward pass). A rank
whose ``--memory`` is below that is left out, with a line saying so, as the paper's Horovod
runs leave out the GPUs too small for ResNet-152 (Table 4's X).
"""
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The models a baseline trains (``--model``), each on its data set.
DATASETS = {"cnn": "hetpipe_digits", "gpt": "hetpipe_addition"}
_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def load_source(name, relative_path):
    """The module at `relative_path` (from the repository root), loaded by path as `name`,
    without importing the package around it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


emulation = load_source("hetpipe_emulation", "hetpipe_tf/pipeline/emulation.py")


class BaselineOptionError(ValueError):
    """A baseline's flag that does not fit the ranks it runs on."""


def _per_rank(text, ranks, flag, parse_one):
    """One value per rank from 'a,b,c' (one item each) or 'a' (the same for all)."""
    items = [item.strip() for item in str(text).split(",")]
    if len(items) not in (1, ranks):
        raise BaselineOptionError(f"{flag}={text!r} gives {len(items)} values for {ranks} ranks; "
                                  f"give one per rank or a single one for all")
    values = [parse_one(item, flag) for item in items]
    return tuple(values * ranks if len(values) == 1 else values)


def _positive(item, flag):
    try:
        value = float(item)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise BaselineOptionError(f"{flag}: {item!r} is not a number > 0")
    return value


def _bytes(item, flag):
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([KMG]?)", item.upper())
    if not m or float(m.group(1)) <= 0:
        raise BaselineOptionError(f"{flag}: {item!r} is not a memory size > 0; use bytes or a number with "
                                  f"K, M or G (powers of 1024), e.g. 8M")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def add_arguments(parser):
    """The flags every baseline takes (its launcher adds how many ranks)."""
    parser.add_argument("--model", default="cnn", choices=sorted(DATASETS),
                        help="cnn on the digits, or gpt on hetpipe_addition's sums")
    parser.add_argument("--speeds", help="each rank's relative speed v, e.g. 1,0.67,0.4,0.33 (one value: every "
                        "rank; default 1)")
    parser.add_argument("--slowdowns", help="each rank's whole factor dilation / v instead of --speeds and "
                        "--dilation, e.g. 3,4.5,7.5,9 (the dilation is the smallest)")
    parser.add_argument("--dilation", type=float, help="the emulation's dilation (default: calibrated until "
                        "fewer than 5%% of paced steps overran)")
    parser.add_argument("--memory", help="each rank's memory, e.g. 8M,8M,8M,2M (one value: every rank; "
                        "default: unlimited); a rank that cannot hold the whole model is left out")
    parser.add_argument("--reference_ms", type=float, help="the solo compute time of a step that the pacing "
                        "scales, instead of measuring it: to emulate the same devices as another system's run")
    parser.add_argument("--epochs", type=int, default=6, help="epochs of training")
    parser.add_argument("--warmup_epochs", type=int, default=1, help="first epochs left out of images/s")
    parser.add_argument("--steps_per_epoch", type=int, default=0,
                        help="steps per epoch (0: every full minibatch of a rank's shard)")
    parser.add_argument("--batch_size", type=int, default=32, help="minibatch of each rank")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--probe_steps", type=int, default=30, help="steps of each rank per calibration probe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--intra_op_threads", type=int, default=1,
                        help="TensorFlow intra-op threads of each rank (1, as hetpipe_tf's stages)")
    parser.add_argument("--real_compute", action="store_true",
                        help="no emulation: each step's compute as the rank's process runs it (a rank's speed is "
                        "its CPU's, e.g. a CPU-quota group's); --speeds, --slowdowns, --dilation and "
                        "--reference_ms are then not taken")
    parser.add_argument("--out", help="also append the JSON line to this file")
    parser.add_argument("--weights_out", help="a folder where each rank saves its final weights (rank_I.npz)")
    return parser


def check(args):
    """Rejects flags no rank count can make right; returns `args`."""
    for flag in ("epochs", "batch_size", "probe_steps", "intra_op_threads"):
        if getattr(args, flag) < 1:
            raise BaselineOptionError(f"--{flag}={getattr(args, flag)} must be >= 1")
    if not 0 <= args.warmup_epochs < args.epochs:
        raise BaselineOptionError(f"--warmup_epochs={args.warmup_epochs} must be from 0 to --epochs - 1 = "
                                  f"{args.epochs - 1}: images/s needs a measured epoch")
    if args.steps_per_epoch < 0:
        raise BaselineOptionError(f"--steps_per_epoch={args.steps_per_epoch} must be >= 0 (0: the whole shard)")
    if args.reference_ms is not None and args.reference_ms <= 0:
        raise BaselineOptionError(f"--reference_ms={args.reference_ms} must be > 0")
    if args.lr <= 0:
        raise BaselineOptionError(f"--lr={args.lr} must be > 0")
    if args.dilation is not None and args.dilation < 1:
        raise BaselineOptionError(f"--dilation={args.dilation} must be >= 1")
    emulation_flags = [f for f in ("speeds", "slowdowns", "dilation", "reference_ms") if getattr(args, f) is not None]
    if getattr(args, "real_compute", False) and emulation_flags:
        raise BaselineOptionError(f"--real_compute runs nothing emulated: leave out "
                                  f"{', '.join('--' + f for f in emulation_flags)}")
    if args.slowdowns is not None and (args.dilation is not None or args.speeds is not None):
        raise BaselineOptionError("--slowdowns gives both the speeds and the dilation: give it without "
                                  "--speeds and --dilation")
    return args


def speeds_and_dilation(args, ranks):
    """(speed of each rank, dilation or None to calibrate) from --speeds/--dilation or --slowdowns."""
    if args.slowdowns is None:
        return _per_rank(args.speeds or "1", ranks, "--speeds", _positive), args.dilation
    slowdowns = _per_rank(args.slowdowns, ranks, "--slowdowns", _positive)
    dilation = min(slowdowns)
    if dilation < 1:
        raise BaselineOptionError(f"--slowdowns={args.slowdowns!r}: the smallest is the dilation, which must "
                                  f"be >= 1")
    return tuple(dilation / s for s in slowdowns), dilation


def memories(args, ranks):
    """Each rank's memory in bytes (None: unlimited)."""
    if args.memory is None:
        return (None,) * ranks
    return _per_rank(args.memory, ranks, "--memory", _bytes)


def model_need(weight_bytes, state_bytes, activation_bytes, optimizer_slots):
    """What one rank holds for the whole model, by category (the memory rule above);
    `activation_bytes` is for one minibatch."""
    return {"weights": weight_bytes, "gradients": weight_bytes, "optimizer slots": optimizer_slots * weight_bytes,
            "non-trainable state": state_bytes, "activations": activation_bytes}


def admit(memory, need):
    """(indices of the ranks that can hold `need`, a line for each one left out)."""
    total = sum(need.values())
    admitted, lines = [], []
    for i, capacity in enumerate(memory):
        if capacity is None or capacity >= total:
            admitted.append(i)
        else:
            lines.append(f"rank {i} left out: its emulated device holds {emulation.format_bytes(capacity)}, "
                         f"the whole model needs {emulation.format_bytes(total)} "
                         f"({emulation.format_breakdown(need)})")
    if not admitted:
        raise BaselineOptionError(f"no rank can hold the whole model ({emulation.format_bytes(total)}); "
                                  f"--memory gave {', '.join(emulation.format_bytes(m) for m in memory)}")
    return admitted, lines


@dataclass(frozen=True)
class Plan:
    """Who trains in a run of `started` ranks: the admitted ranks (indices among all) and their
    speeds, the dilation (None: calibrate), the lines about the ranks left out, the model's need."""
    started: int
    admitted: tuple
    speeds: tuple
    dilation: float | None
    left_out: tuple
    need: dict

    def index(self, rank):
        """This rank's index among the admitted ones, or None when it was left out."""
        return self.admitted.index(rank) if rank in self.admitted else None


def plan(args, started, need):
    """The Plan of `started` ranks under the flags `args` (checked) for a model that needs `need`."""
    speeds, dilation = speeds_and_dilation(args, started)
    admitted, lines = admit(memories(args, started), need)
    return Plan(started, tuple(admitted), tuple(speeds[i] for i in admitted), dilation, tuple(lines), need)


def images_per_second(images_per_epoch, epoch_seconds, warmup_epochs):
    """Images/s (examples/s: sequences of ``gpt``) over the epochs after the warm-up ones."""
    measured = epoch_seconds[warmup_epochs:]
    return images_per_epoch * len(measured) / sum(measured)


def host_fields(busy):
    """A row's fields on the host's CPU: its busy share and whether it was saturated (above
    emulation.HOST_SATURATED: then the host, not the emulated devices, set the pace)."""
    return {"host_cpu_busy": busy,
            "host_saturated": None if busy is None else busy > emulation.HOST_SATURATED}


def record(system, args, plan, reference_s, report, epoch_seconds, epoch_accuracy, images_per_epoch,
           steps_per_epoch, host_cpu_busy=None, tokens_per_example=None):
    """The JSON line of one run (a dict); `report` is the training epochs' EmulationReport (None,
    with `reference_s` None, for a run of real compute: nothing emulated),
    `host_cpu_busy` the host's busy CPU share over the epochs images/s counts (emulation.HostCpu);
    with `tokens_per_example` (sequences), also tokens/s: images/s times it."""
    wall, elapsed = [], 0.0
    for seconds in epoch_seconds:
        elapsed += seconds
        wall.append(round(elapsed, 3))
    line = {"system": system, "model": args.model, "dataset": DATASETS[args.model], "ranks": len(plan.admitted),
            "ranks_started": plan.started, "speeds": [round(v, 4) for v in plan.speeds],
            "left_out": list(plan.left_out), "model_need_bytes": sum(plan.need.values()), "batch_size_per_rank": args.batch_size,
            "steps_per_epoch": steps_per_epoch, "epochs": args.epochs, "warmup_epochs": args.warmup_epochs,
            "images_per_s": round(images_per_second(images_per_epoch, epoch_seconds, args.warmup_epochs), 2),
            **host_fields(host_cpu_busy),
            "epoch_test_accuracy": [round(a, 4) for a in epoch_accuracy], "epoch_wall_s": wall}
    if report is None:  # every rank at its own CPU's speed: none assumed
        line.update(emulated=False, speeds=None)
    else:
        line.update(reference_ms=round(reference_s * 1e3, 3), reference_measured=args.reference_ms is None,
                    **report.as_dict())
    if tokens_per_example:
        line["tokens_per_s"] = round(line["images_per_s"] * tokens_per_example, 1)
    warning = report.warning() if report is not None else None
    if warning:
        line["warning"] = warning
    return line


def publish(plan, line, out=None):
    """Prints the lines about the ranks left out and the JSON line; appends the latter to `out`."""
    for text in plan.left_out:
        print(text)
    print(json.dumps(line), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
