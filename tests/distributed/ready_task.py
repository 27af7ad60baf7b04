"""A task process for the starter's tests: it takes the flags every task takes, prints the
ready line and waits (without TensorFlow, so that it starts at once); --fail exits first."""
import sys
import time

from absl import app, flags

from hetpipe_tf.distributed.heartbeat import HeartbeatResponder, end_with_parent

flags.DEFINE_string("address", None, "This task's address.")
flags.DEFINE_integer("parent_pid", 0, "End with this process.")
flags.DEFINE_float("chief_timeout_s", 0.0, "End when the chief is silent this long.")
flags.DEFINE_bool("fail", False, "Exit with status 3 before the ready line.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    if FLAGS.fail:
        print("failing as asked", flush=True)
        sys.exit(3)
    end_with_parent(FLAGS.parent_pid)
    heartbeat = HeartbeatResponder(FLAGS.address.rsplit(":", 1)[0]).start()
    print(f"ready at {FLAGS.address}; heartbeat at {heartbeat.address}", flush=True)
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    app.run(main)
