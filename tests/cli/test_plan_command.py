"""`hetpipe plan` and `hetpipe-train` share their planning flags and the plan assembly: given the same
flags and profile, `hetpipe plan` prints the plan that `hetpipe-train` trains."""
import dataclasses
import subprocess
import sys
import types

import pytest

from hetpipe_tf.api.strategy import HetPipeStrategy
from hetpipe_tf.cli import models
from hetpipe_tf.cli.plan_flags import plan_request, request_arguments
from hetpipe_tf.planning.profile import SegmentTimes
from hetpipe_tf.runtime.profiler import model_profile
from tests.helpers.cli import hetpipe_train


def _profile_file(path):
    """The profile of hetpipe-train's mlp on the bundled digits at batch 32, with host times of its own
    (not measured: both commands plan from exactly these), written as Profile.to_json writes it."""
    profile = model_profile(models.build_model("mlp", (8, 8, 1), 10), 32)
    n = profile.num_segments
    times = SegmentTimes(forward=tuple(0.002 * (i + 1) for i in range(n)),
                         backward=tuple(0.004 * (i + 1) for i in range(n)),
                         forward_overhead=0.0003, backward_overhead=0.0005, source="given to both commands")
    path.write_text(profile.with_times("host", times).to_json())
    return path


def test_both_commands_and_the_strategy_make_one_request_of_the_same_arguments():
    flags = types.SimpleNamespace(policy="np", vw_size=2, num_in_flight=3, staleness_bound=0, placement=None,
                                  dilation=2.0, schedule="hetpipe", sync="pipe-sgd", pipe_sgd_staleness=0,
                                  compression="quant8", uneven_minibatches=True)
    request = plan_request(flags)
    assert (request.policy, request.vw_size, request.num_in_flight, request.staleness_bound, request.dilation,
            request.minibatch_sizes) == ("np", 2, 3, 0, 2.0, "proportional")
    assert request.sync.name == "pipe-sgd(k=0, compression=quant8)"
    assert request.placement_of_policy == "default"  # local is ED's
    strategy = HetPipeStrategy(cluster="local", launch="in_process", **request_arguments(flags))
    assert strategy.request.sync.name == request.sync.name  # a PipeSGD each, made of the same flags
    assert dataclasses.replace(strategy.request, sync=request.sync) == request


@pytest.mark.slow
def test_hetpipe_plan_with_a_training_runs_flags_and_profile_prints_the_plan_it_trains(tmp_path):
    """Two processes: `hetpipe plan` and a short in-process `hetpipe-train --cluster=local` run, given the
    same planning flags and profile file; the plan printed is the plan trained (allocation, cuts,
    Nm, placement, prediction, notes)."""
    shared = ["--cluster=local", "--model=mlp", "--policy=ed", "--staleness_bound=1", "--dilation=2",
              f"--profile={_profile_file(tmp_path / 'mlp.json')}"]
    planned = subprocess.run([sys.executable, "-m", "hetpipe_tf.cli.hetpipe", "plan", *shared],
                             capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr[-2000:]
    trained = hetpipe_train(tmp_path, *shared, "--launch=in_process", "--epochs=1", "--steps_per_epoch=2")
    assert trained.returncode == 0, trained.stderr[-2000:]
    plan = planned.stdout.strip()
    assert "placement local, D=1" in plan and "note: times for host: given to both commands" in plan
    assert plan in trained.stdout, (plan, trained.stdout)


def test_a_profile_without_a_plan_to_make_is_a_usage_error(tmp_path):
    run = hetpipe_train(tmp_path, f"--profile={tmp_path / 'mlp.json'}")
    assert run.returncode == 2 and "--profile is what the planner plans with: give --cluster" in run.stderr, run.stderr
