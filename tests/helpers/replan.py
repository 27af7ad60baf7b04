"""What the re-planning tests share (tests/runtime/test_replan_switch.py, in one process, and
tests/runtime/test_replan_processes.py, whose chief scripts, run from the repository's root, import it)."""
from hetpipe_tf.planning.profile import Profile, SegmentTimes
from hetpipe_tf.runtime.profiler import model_profile

#: The re-planning tests' minibatch size.
BATCH = 32


def given_profile(model, batch_size: int = BATCH) -> Profile:
    """`model`'s profile at `batch_size` with times given, not measured, well above the host's
    compute (a Dense(512) pass takes well under a millisecond), which the emulated devices are
    paced to: the plans, and whether a slowdown pays for a switch, do not depend on how busy the
    host is."""
    profile = model_profile(model, batch_size)
    n = profile.num_segments
    return profile.with_times("host", SegmentTimes((0.004,) * n, (0.008,) * n, 0.0005, 0.001, "given"))
