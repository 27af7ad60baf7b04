"""The pipeline layer (pure Python, no TensorFlow): the instruction vocabulary, schedules,
the simulator, the executor that carries a schedule out with one thread per stage, the
emulation rules and the trace (HetPipe §4)."""

from hetpipe_tf.pipeline import hetpipe  # noqa: E402,F401 - registers the "hetpipe" schedule
from hetpipe_tf.pipeline import gpipe, naivepipe, pipedream  # noqa: E402,F401 - and the classic ones
from hetpipe_tf.pipeline import taylorpipe  # noqa: E402,F401 - and TaylorPipe's
