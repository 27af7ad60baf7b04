"""The flags ``hetpipe-train`` and ``hetpipe plan`` share: what a run asks the planner for, defined
once with one name and one meaning in both commands (and named as ``HetPipeStrategy``'s
arguments), and the one function that makes the request of them (:func:`plan_request`), so that
``hetpipe plan`` with a ``hetpipe-train`` run's flags plans that run."""
from absl import flags

import hetpipe_tf.pipeline  # noqa: F401 - registers the schedules
import hetpipe_tf.sync  # noqa: F401 - registers the schemes
from hetpipe_tf.pipeline.schedule import SyncScheme, check_combination
from hetpipe_tf.planning.allocation import POLICIES
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.sync.pipe_sgd import PipeSGD
from hetpipe_tf.sync.wsp import PLACEMENTS


def define_plan_flags() -> None:
    """Defines the shared flags, with the checks absl runs on them while parsing."""
    flags.DEFINE_enum("policy", "ed", list(POLICIES) + ["auto"],
                      "How the cluster's devices are grouped into virtual workers (§8.1), or auto (the best "
                      "predicted of every allocation).")
    flags.DEFINE_integer("vw_size", None, "Devices per virtual worker (default: the policy's, the smallest node's "
                                          "device count).", lower_bound=1)
    flags.DEFINE_integer("num_in_flight", None, "Nm, minibatches in flight per virtual worker (default: the "
                                                "planner's choice; one virtual worker without --plan=auto: its "
                                                "number of stages).", lower_bound=1)
    flags.DEFINE_integer("staleness_bound", 0, "D of Wave Synchronous Parallel (§5), in waves; s of --sync=ssp, in "
                                               "minibatches; --sync=bsp and asp take only 0.", lower_bound=0)
    flags.DEFINE_enum("placement", None, list(PLACEMENTS),
                      "Parameter placement on the servers (default: local for ED, else default).")
    flags.DEFINE_float("dilation", None, "Multiplies every emulated device's slowdown. Default: calibrated by short "
                                         "probe runs before training, the smallest at which fewer than 2.5 percent "
                                         "of the tasks overran (a run above 5 percent is not faithful and says so); "
                                         "planned at 1.", lower_bound=1.0)
    flags.DEFINE_string("schedule", "hetpipe", "How each virtual worker pipelines its minibatches: a registered "
                                               "schedule (hetpipe_tf.pipeline.schedule.combinations lists them).")
    flags.DEFINE_string("sync", "wsp", "How the virtual workers synchronise, a registered scheme (default: WSP, §5; "
                                       "also bsp, ssp, asp: per-minibatch clocks, §2.2; pipe-sgd: all-reduce, no "
                                       "servers, Pipe-SGD).")
    flags.DEFINE_integer("pipe_sgd_staleness", 1, "With --sync=pipe-sgd: the gradient staleness k (Pipe-SGD, "
                         "Algorithm 1: minibatch t waits for the aggregate of t - (k + 1); 1 is Pipe-SGD's optimum, "
                         "0 is synchronous all-reduce SGD).", lower_bound=0)
    flags.DEFINE_enum("compression", "none", ["none", "truncate16", "quant8"],
                      "With --sync=pipe-sgd: what the all-reduce communicates (Pipe-SGD): float32 as it is, "
                      "truncated to its 16 high bits, or 8-bit scalar quantisation.")
    flags.DEFINE_bool("uneven_minibatches", False,
                      "Give each virtual worker a minibatch size proportional to its predicted throughput (within its "
                      "memory) out of --batch_size times the number of workers, and weight the servers' pushes by it "
                      "(beyond the paper; pays off where workers are unequal, as under --policy=np).")
    flags.DEFINE_string("profile", None, "Plan with this profile of the model at --batch_size (a JSON file as "
                                         "Profile.to_json writes it, e.g. of an earlier run's plan) instead of "
                                         "measuring one; the same profile gives both commands the same plan.")
    flags.register_multi_flags_validator(["schedule", "sync", "staleness_bound"], _registered_combination)
    flags.register_multi_flags_validator(
        ["sync", "pipe_sgd_staleness", "compression"],
        lambda v: v["sync"] == "pipe-sgd" or (v["pipe_sgd_staleness"], v["compression"]) == (1, "none"),
        message="--pipe_sgd_staleness and --compression are Pipe-SGD's: give --sync=pipe-sgd too, or drop them")


def _registered_combination(values: dict) -> bool:
    try:
        check_combination(values["schedule"], values["sync"])[1].checked_bound(values["staleness_bound"])
    except ValueError as exc:
        raise flags.ValidationError(f"--schedule={values['schedule']} --sync={values['sync']} "
                                    f"--staleness_bound={values['staleness_bound']}: {exc}") from None
    return True


def chosen_sync(values: flags.FlagValues) -> str | SyncScheme:
    """The synchronisation scheme the flags name: --sync, with Pipe-SGD's k and compression."""
    if values.sync != "pipe-sgd":
        return values.sync
    return PipeSGD(staleness=values.pipe_sgd_staleness, compression=values.compression)


def request_arguments(values: flags.FlagValues) -> dict[str, object]:
    """The shared flags as ``HetPipeStrategy``'s planning arguments (the same names)."""
    return dict(policy=values.policy, vw_size=values.vw_size, num_in_flight=values.num_in_flight,
                staleness_bound=values.staleness_bound, placement=values.placement, dilation=values.dilation,
                schedule=values.schedule, sync=chosen_sync(values), uneven_minibatches=values.uneven_minibatches)


def plan_request(values: flags.FlagValues) -> PlanRequest:
    """The request the shared flags make, as ``HetPipeStrategy`` makes it of the same arguments."""
    return PlanRequest.asked(**request_arguments(values))
