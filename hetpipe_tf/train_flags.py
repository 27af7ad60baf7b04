"""Flags of the hetpipe-train binary, defined in one place."""
from absl import flags

from hetpipe_tf import datasets, models

DEFAULT_DEVICES = "1@32M,0.5@32M,0.5@32M,0.25@32M"


def define_flags():
    flags.DEFINE_enum("model", "cnn", list(models.MODELS), "Model to train.")
    flags.DEFINE_string("dataset", "hetpipe_digits",
                        "TFDS dataset name; hetpipe_digits ships with the package, others must be "
                        "prepared in --data_dir (nothing is downloaded).")
    flags.DEFINE_string("data_dir", datasets.DEFAULT_DATA_DIR, "TFDS data directory.")
    flags.DEFINE_string("devices", None,
                        "Devices of the virtual worker, one per stage: SPEED@MEMORY (emulated), cpu, "
                        f"gpu:I[@MEMORY]. Default: {DEFAULT_DEVICES} (emulated, heterogeneous).")
    flags.DEFINE_integer("num_stages", None,
                         "Number of stages; without --devices, that many emulated devices of speed 1.")
    flags.DEFINE_list("boundaries", None, "First layer call of each stage, e.g. 0,5,9 (default: balanced).")
    flags.DEFINE_enum("plan", "none", ["none", "auto"],
                      "auto: profile the model on this host and let the planner choose the device order, "
                      "the stage boundaries and Nm (memory per stage position included); none: --boundaries, "
                      "or a static FLOP balance, and --num_minibatches.")
    flags.DEFINE_integer("num_minibatches", None, "Nm, minibatches in flight (default: the number of stages).")
    flags.DEFINE_integer("batch_size", 32, "Minibatch size.")
    flags.DEFINE_integer("epochs", 12, "Epochs.")
    flags.DEFINE_integer("steps_per_epoch", None, "Minibatches per epoch (default: the whole training split).")
    flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam", "rmsprop"], "Optimizer.")
    flags.DEFINE_float("learning_rate", 0.02, "Learning rate.")
    flags.DEFINE_float("momentum", 0.9, "Momentum (sgd).")
    flags.DEFINE_integer("image_size", None, "Resize images to this side (keras.applications models need >= 32).")
    flags.DEFINE_float("dilation", 3.0, "Multiplies every emulated device's slowdown; raise it until the "
                                        "emulation's overrun_fraction is small (4 emulated devices on 2 "
                                        "cores need about 3).")
    flags.DEFINE_integer("intra_op_threads", 1, "TensorFlow intra-op threads (1: each stage uses about one core).")
    flags.DEFINE_integer("inter_op_threads", 0, "TensorFlow inter-op threads (0: TensorFlow's choice).")
    flags.DEFINE_float("timeout_s", 300.0, "Fail when the pipeline makes no progress for this long.")
    flags.DEFINE_string("trace_file", None, "Write the pipeline timeline here (Chrome/Perfetto trace JSON).")
    flags.DEFINE_string("tensorboard_dir", None, "Write TensorBoard scalars here.")
    flags.DEFINE_integer("seed", 0, "Random seed.")
    flags.DEFINE_bool("show_schedule", True, "Print the first minibatches of every stage's program.")
    # Several virtual workers (HetPipe §5, §8): given --cluster, HetPipeStrategy plans and launches.
    flags.DEFINE_string("cluster", None,
                        "Train several virtual workers under WSP on this cluster description (a preset such "
                        "as 'local', or a JSON file); without it, one virtual worker on --devices.")
    flags.DEFINE_enum("policy", "ed", ["np", "ed", "hd", "auto"], "With --cluster: how devices are grouped into "
                                                                   "virtual workers (§8.1).")
    flags.DEFINE_integer("num_vws", None, "With --cluster: the number of virtual workers (default: the policy's).")
    flags.DEFINE_integer("staleness_bound", 0, "With --cluster: D of Wave Synchronous Parallel (§5).")
    flags.DEFINE_enum("placement", None, ["default", "local"],
                      "With --cluster: parameter placement on the servers (default: local for ED, else default).")
    flags.DEFINE_enum("launch", "processes", ["processes", "tf_config", "in_process"],
                      "With --cluster: processes (start a local cluster of ps and worker tasks), tf_config (join "
                      "TF_CONFIG's cluster, e.g. under `hetpipe launch`), in_process (threads).")
