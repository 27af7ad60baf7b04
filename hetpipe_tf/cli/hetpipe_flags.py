"""Flags of the `hetpipe` command (plan, simulate, launch, trace plot), defined in one place, with
the ranges absl checks while parsing."""
from absl import flags

from hetpipe_tf.cli import models, plan_flags

#: What the binaries' --optimizer flag takes (hetpipe_tf.runtime.optimizers.by_name makes them; listed
#: here so that the flags parse without loading Keras).
OPTIMIZERS = ("sgd", "adam", "adamw", "adamax", "nadam", "lion", "adafactor", "adagrad", "adadelta", "ftrl",
              "rmsprop", "lamb", "muon", "schedulefreeadamw")


# Models `hetpipe plan` predicts beside the zoo's (hetpipe_tf.cli.models): keras_hub's backbones from a
# config (hetpipe_tf.cli.hetpipe.build_transformer), built only to read their graphs.
TRANSFORMERS = {"gpt2_medium": {"vocabulary_size": 50257, "num_layers": 24, "num_heads": 16, "hidden_dim": 1024,
                                "intermediate_dim": 4096, "max_sequence_length": 1024}}


def define_flags() -> None:
    plan_flags.define_plan_flags()  # what the planner is asked for, as hetpipe-train takes it
    flags.DEFINE_string("cluster", "paper", "Cluster: a preset (paper, local) or a JSON file.")
    flags.DEFINE_enum("model", "resnet152", list(models.MODELS) + list(TRANSFORMERS),
                      "Model to plan for (gpt2_medium: a GPT-2-medium-sized transformer, keras_hub; plan only).")
    flags.DEFINE_integer("batch_size", 32, "Minibatch size.", lower_bound=1)
    flags.DEFINE_list("input_shape", None, "Input image shape H,W,C (default: 224,224,3 for keras.applications "
                                           "models, else the bundled digits' 8,8,1).")
    flags.DEFINE_integer("num_classes", None, "Classes (default: 1000 for keras.applications models, else 10).",
                         lower_bound=1)
    flags.DEFINE_enum("method", "milp", ["milp", "dp"], "Partitioner.")
    flags.DEFINE_enum("optimizer", "sgd", list(OPTIMIZERS), "Optimizer (its slots take memory).")
    flags.DEFINE_integer("sequence_length", None, "Transformers: the sequence planned for (default: the model's "
                         "longest, 1024 for gpt2_medium).", lower_bound=1)
    flags.DEFINE_float("momentum", 0.9, "SGD momentum (0: no slot).", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_float("time_budget_s", None, "plan/simulate with --policy=auto: stop trying allocations after this "
                       "many seconds and take the best found (the three policies' own are always tried).",
                       lower_bound=0.001)
    flags.DEFINE_integer("steps", 400, "simulate: minibatches (steps) per virtual worker.", lower_bound=1)
    flags.DEFINE_bool("json", False, "Print JSON instead of a table.")
    flags.DEFINE_string("png", None, "plan: also draw the plan into this PNG file (needs matplotlib).")
    flags.DEFINE_string("output", None, "trace plot: the PNG to write (default: the trace's path ending in .png).",
                        short_name="o")
    flags.DEFINE_string("task_log_dir", None, "launch: where the tasks' logs go (default: a temporary directory).")
    flags.DEFINE_string("host", "127.0.0.1", "launch: the address the tasks bind.")
    flags.DEFINE_float("timeout_s", 300.0, "launch: a task silent this long (or dead) is lost; the run then ends.",
                       lower_bound=0.1)
    flags.DEFINE_bool("emulate_links", None, "launch: run each node's tasks in a network namespace of its own, joined by links of the "
                       "cluster's inter-node bandwidth and latency (root needed). Default: the cluster "
                       "description's links.emulate.")
    flags.register_validator("input_shape", _image_shape,
                             message="--input_shape must be three positive integers H,W,C, e.g. 224,224,3")


def _image_shape(values: list[str] | None) -> bool:
    try:
        return values is None or (len(values) == 3 and all(int(v) > 0 for v in values))
    except ValueError:
        return False
