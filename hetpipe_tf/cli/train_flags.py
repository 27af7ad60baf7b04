"""Flags of the hetpipe-train binary, defined in one place, with the checks absl runs on them
while parsing: a value out of its range, or flags that contradict each other, is reported
before anything starts."""
from typing import Any

from absl import flags

from hetpipe_tf.data import DEFAULT_DATA_DIR

from hetpipe_tf.cli import models, plan_flags
from hetpipe_tf.cli.hetpipe_flags import OPTIMIZERS

DEFAULT_DEVICES = "1@32M,0.5@32M,0.5@32M,0.25@32M"


#: --mixed_precision -> the Keras dtype policy the model is built under.
MIXED_PRECISION = {"none": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def define_flags() -> None:
    flags.DEFINE_enum("model", "cnn", list(models.MODELS), "Model to train.")
    flags.DEFINE_string("dataset", "hetpipe_digits",
                        "TFDS dataset name; hetpipe_digits ships with the package, others must be "
                        "prepared in --data_dir (nothing is downloaded).")
    flags.DEFINE_string("data_dir", DEFAULT_DATA_DIR, "TFDS data directory.")
    flags.DEFINE_string("devices", None,
                        "Devices of the virtual worker, one per stage: SPEED@MEMORY (emulated), cpu, "
                        f"gpu:I[@MEMORY]. Default: {DEFAULT_DEVICES} (emulated, heterogeneous).")
    flags.DEFINE_integer("num_stages", None,
                         "Number of stages; without --devices, that many emulated devices of speed 1.",
                         lower_bound=1)
    flags.DEFINE_list("boundaries", None, "First layer call of each stage, e.g. 0,5,9 (default: balanced).")
    flags.DEFINE_enum("plan", "none", ["none", "auto"],
                      "auto: profile the model on this host and let the planner choose the device order, "
                      "the stage boundaries and Nm (memory per stage position included); none: --boundaries, "
                      "or a static FLOP balance, and --num_in_flight.")
    flags.DEFINE_integer("batch_size", 32, "Minibatch size.", lower_bound=1)
    flags.DEFINE_integer("epochs", 12, "Epochs (hetpipe_addition: 20 unless given).", lower_bound=1)
    flags.DEFINE_integer("steps_per_epoch", None, "Minibatches per epoch (default: the whole training split).",
                         lower_bound=1)
    flags.DEFINE_enum("optimizer", "sgd", list(OPTIMIZERS), "Optimizer (keras.optimizers, by its class name in "
                                                           "lower case).")
    flags.DEFINE_float("learning_rate", 0.01, "Learning rate.", lower_bound=0.0)
    flags.DEFINE_float("momentum", 0.9, "Momentum (sgd).", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_float("weight_decay", None, "Decoupled weight decay (default: the optimizer's own, AdamW's 0.004). "
                                             "Under WSP each worker decays its local weights.", lower_bound=0.0)
    flags.DEFINE_float("global_clipnorm", None, "Clip every minibatch's gradient by the norm of all the stages' "
                                                "gradients together (Keras's global_clipnorm; "
                                                "hetpipe_addition: 1 unless given).", lower_bound=0.0)
    flags.DEFINE_enum("mixed_precision", "none", list(MIXED_PRECISION),
                      "Compute in bfloat16 (bf16) or float16 (fp16, with dynamic loss scaling, one scale per "
                      "virtual worker); weights stay float32.")
    flags.DEFINE_integer("image_size", None, "Resize images to this side (keras.applications models need >= 32).",
                         lower_bound=1)
    flags.DEFINE_integer("intra_op_threads", 1, "TensorFlow intra-op threads (1: each stage uses about one core).",
                         lower_bound=0)
    flags.DEFINE_integer("inter_op_threads", 0, "TensorFlow inter-op threads (0: TensorFlow's choice).",
                         lower_bound=0)
    flags.DEFINE_float("timeout_s", 300.0, "Fail when the pipeline makes no progress for this long.")
    flags.DEFINE_bool("emulate_links", None, "With --launch=processes: run each node's tasks in a network namespace of its own, joined by links of the "
                       "cluster's inter-node bandwidth and latency (root needed). Default: the cluster "
                       "description's links.emulate.")
    flags.DEFINE_string("trace_file", None, "Write the pipeline timeline here (Chrome/Perfetto trace JSON).")
    flags.DEFINE_string("tensorboard_dir", None, "Write TensorBoard scalars here.")
    flags.DEFINE_integer("seed", 0, "Random seed.")
    flags.DEFINE_bool("show_schedule", True, "Print the first minibatches of every stage's program.")
    plan_flags.define_plan_flags()  # what the planner is asked for, as `hetpipe plan` takes it
    # Several virtual workers (HetPipe §5, §8): given --cluster, HetPipeStrategy plans and launches.
    flags.DEFINE_string("cluster", None,
                        "Train several virtual workers under WSP on this cluster description (a preset such "
                        "as 'local', or a JSON file); without it, one virtual worker on --devices.")
    flags.DEFINE_enum("launch", "processes", ["processes", "tf_config", "in_process"],
                      "With --cluster: processes (start a local cluster of ps and worker tasks), tf_config (join "
                      "TF_CONFIG's cluster, e.g. under `hetpipe launch`), in_process (threads).")
    flags.DEFINE_string("checkpoint_dir", None,
                        "With --cluster: save the run here (global weights, every stage's optimizer state, clocks, "
                        "data positions, plan) every --save_every_epochs epochs and at the end; the pipelines "
                        "drain at every epoch's end (hetpipe_tf.runtime.checkpoint).")
    flags.DEFINE_integer("save_every_epochs", 1, "With --checkpoint_dir: save every this many epochs.", lower_bound=1)
    flags.DEFINE_bool("resume", False, "With --checkpoint_dir: continue from its newest checkpoint (under any plan) up "
                                       "to --epochs.")
    flags.DEFINE_enum("on_worker_failure", "stop", ["stop", "continue"],
                      "With --cluster and --launch=processes or tf_config, when a virtual worker's process is lost "
                      "(killed, or no heartbeat for --timeout_s): stop (end the run with an error naming it) or "
                      "continue (go on without it; a new process takes its place at the epoch's end, from the "
                      "global weights; the pipelines then drain at every epoch's end).")
    flags.DEFINE_enum("replan", "off", ["off", "auto"],
                      "With --cluster: auto re-plans when a device slows down for good and "
                      "switches to the new plan at a drained wave boundary when the gain pays for it "
                      "(hetpipe_tf.runtime.replan); off (default) keeps the plan made before training.")
    flags.register_validator("timeout_s", lambda v: v > 0, message="--timeout_s must be > 0 seconds")
    flags.register_validator("boundaries", _integers,
                             message="--boundaries must be integers (each stage's first layer call), e.g. 0,5,9")
    # absl runs validators in the order registered and reports the first that fails.
    for name in ("devices", "num_stages", "boundaries"):
        flags.register_multi_flags_validator(
            ["cluster", name], lambda v, name=name: v["cluster"] is None or v[name] is None,
            message=f"--{name} is for one virtual worker; with --cluster the planner chooses it: "
                    f"drop --{name} or --cluster")
    flags.register_multi_flags_validator(
        ["cluster", "checkpoint_dir"], lambda v: v["cluster"] is not None or v["checkpoint_dir"] is None,
        message="--checkpoint_dir checkpoints runs of virtual workers under WSP: give --cluster too (e.g. "
                "--cluster=local), or drop --checkpoint_dir")
    flags.register_multi_flags_validator(
        ["resume", "checkpoint_dir"], lambda v: not v["resume"] or bool(v["checkpoint_dir"]),
        message="--resume needs the --checkpoint_dir to resume from")
    flags.register_multi_flags_validator(
        ["cluster", "plan", "profile"],
        lambda v: v["profile"] is None or v["cluster"] is not None or v["plan"] == "auto",
        message="--profile is what the planner plans with: give --cluster (or --plan=auto for one virtual worker) "
                "too, or drop --profile")
    flags.register_multi_flags_validator(
        ["plan", "boundaries"], lambda v: v["plan"] != "auto" or v["boundaries"] is None,
        message="--plan=auto chooses the boundaries; drop --boundaries or --plan=auto")
    flags.register_multi_flags_validator(
        ["cluster", "sync"], lambda v: v["cluster"] is not None or v["sync"] == "wsp",
        message="--sync chooses how several virtual workers synchronise: give --cluster too (e.g. --cluster=local), "
                "or drop --sync")
    flags.register_multi_flags_validator(
        ["cluster", "launch", "on_worker_failure"],
        lambda v: v["on_worker_failure"] == "stop" or (v["cluster"] is not None and v["launch"] != "in_process"),
        message="--on_worker_failure=continue goes on without a lost virtual worker's process: give --cluster with "
                "--launch=processes or tf_config, or drop --on_worker_failure")
    flags.register_multi_flags_validator(
        ["cluster", "uneven_minibatches"], lambda v: v["cluster"] is not None or not v["uneven_minibatches"],
        message="--uneven_minibatches sizes the minibatches of several virtual workers: give --cluster too (e.g. "
                "--cluster=local --policy=np), or drop --uneven_minibatches")
    flags.register_multi_flags_validator(
        ["cluster", "on_worker_failure", "replan"],
        lambda v: v["replan"] == "off" or (v["cluster"] is not None and v["on_worker_failure"] == "stop"),
        message="--replan=auto switches plans within a run of several virtual workers, every one of them in the "
                "run: give --cluster with --on_worker_failure=stop, or drop --replan")
    flags.register_multi_flags_validator(["devices", "num_stages"], _one_device_per_stage)
    flags.register_multi_flags_validator(["devices", "num_stages", "boundaries"], _one_boundary_per_stage)


def _integers(values: list[str] | None) -> bool:
    try:
        [int(v) for v in values or ()]
    except ValueError:
        return False
    return True


def _one_device_per_stage(values: dict[str, Any]) -> bool:
    devices, num_stages = values["devices"], values["num_stages"]
    if devices is not None and num_stages is not None and len(devices.split(",")) != num_stages:
        raise flags.ValidationError(f"--num_stages={num_stages} but --devices lists {len(devices.split(','))} "
                                    f"devices: give one device per stage")
    return True


def _one_boundary_per_stage(values: dict[str, Any]) -> bool:
    devices, num_stages, boundaries = values["devices"], values["num_stages"], values["boundaries"]
    if devices is not None:
        stages, where = len(devices.split(",")), "--devices lists {}"
    elif num_stages is not None:
        stages, where = num_stages, "--num_stages={}"
    else:
        stages, where = len(DEFAULT_DEVICES.split(",")), f"the default --devices={DEFAULT_DEVICES} has {{}}"
    if boundaries is not None and len(boundaries) != stages:
        raise flags.ValidationError(f"--boundaries gives {len(boundaries)} stages but {where.format(stages)}: "
                                    f"give one boundary per stage (its first layer call, the first one 0)")
    return True
