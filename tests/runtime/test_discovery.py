"""cluster="discover": this machine's devices grouped into types and measured on the model, cluster
files whose accelerator types are measured instead of given a peak, and --plan=auto on real devices.

This machine has no GPU: discovery finds its host CPU. The GPU path runs through a fake listing
(discovery.physical_devices replaced) whose GPUs TensorFlow serves on the host CPU, so that every
step above the listing (grouping, memory, the timed passes, the plan) runs for real."""
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from hetpipe_tf.api.strategy import HetPipeStrategy
from hetpipe_tf.cli import models
from hetpipe_tf.planning.cluster import ClusterError, from_device_specs, load_cluster
from hetpipe_tf.planning.devices import parse_devices
from hetpipe_tf.planning.planner import plan
from hetpipe_tf.planning.profile import SegmentTimes, measured_cluster
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.runtime import discovery
from hetpipe_tf.runtime.discovery import PhysicalDevice
from hetpipe_tf.runtime.profiler import model_profile
from tests.helpers.cli import hetpipe_train

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
GiB = 2 ** 30


def _mlp():
    return models.build_model("mlp", (8, 8, 1), 10)


def _sample():
    rng = np.random.default_rng(0)
    return rng.random((32, 8, 8, 1), dtype="float32"), rng.integers(0, 10, 32)


def _profile(model):
    """The mlp's profile at batch 32 with host times of its own (made up: the planner's input)."""
    profile = model_profile(model, 32)
    n = profile.num_segments
    return profile.with_times("host", SegmentTimes((0.002,) * n, (0.004,) * n, 0.0003, 0.0005, "given"))


def _fake_listing():
    """A host CPU and three GPUs of two kinds, each GPU served by TensorFlow's host CPU here."""
    cpu = PhysicalDevice("CPU", 0, "a host CPU", None, 64 * GiB, discovery.HOST_DEVICE)
    a100 = [PhysicalDevice("GPU", i, "NVIDIA A100-SXM4-40GB", (8, 0), (40 - i) * GiB, discovery.HOST_DEVICE)
            for i in range(2)]
    t4 = PhysicalDevice("GPU", 2, "Tesla T4", (7, 5), 15 * GiB, discovery.HOST_DEVICE)
    return [cpu, *a100, t4]


def test_discovery_here_finds_the_host_cpu_with_its_memory_and_a_measured_speed():
    cluster = discovery.discover_cluster()
    assert cluster.discovered and cluster.name == "discover"
    assert [(n.device_type, n.count) for n in cluster.nodes] == [("CPU", 1)]
    cpu = cluster.device_types["CPU"]
    assert cpu.host_cpu and cpu.memory == discovery.host_memory() > GiB
    assert "no GPU" in discovery.describe_discovered(cluster)
    speeds = discovery.measure_device_speeds(_mlp(), _sample(), [cpu], LOSS)
    assert speeds["CPU"].pass_seconds > 0 and speeds["CPU"].speed == 1.0  # the host CPU is the reference


def test_two_gpu_kinds_are_two_types_with_memory_from_their_details_measured_and_planned(monkeypatch):
    monkeypatch.setattr(discovery, "physical_devices", _fake_listing)
    cluster = discovery.discover_cluster()
    assert [(n.name, n.device_type, n.count) for n in cluster.nodes] == [("host-G0", "G0", 2), ("host-G1", "G1", 1)]
    assert [n.gpus for n in cluster.nodes] == [(0, 1), (2,)]  # the GPUs launch='processes' gives each node
    a100, t4 = cluster.device_types["G0"], cluster.device_types["G1"]
    assert (a100.device_name, a100.memory, a100.label) == ("NVIDIA A100-SXM4-40GB", 39 * GiB,
                                                           "NVIDIA A100-SXM4-40GB (compute capability 8.0)")
    assert (t4.device_name, t4.memory) == ("Tesla T4", 15 * GiB)
    assert a100.measured and t4.measured and not cluster.on_host
    model = _mlp()
    profile = discovery.with_device_speeds(_profile(model), model, _sample, cluster, LOSS)
    assert {"G0", "G1"} <= set(profile.times)
    assert "measured on /device:CPU:0" in profile.times["G0"].source
    planned = plan(profile, cluster, PlanRequest.asked(policy="ed"))
    assert planned.workers and any("divided by the speed" in note for note in planned.notes)


def test_hd_compares_measured_types_by_their_speed(monkeypatch):
    monkeypatch.setattr(discovery, "physical_devices", lambda: _fake_listing()[:3] + [
        PhysicalDevice("GPU", 2 + i, "Tesla T4", (7, 5), 15 * GiB, discovery.HOST_DEVICE) for i in range(2)])
    cluster = discovery.discover_cluster()
    profile = _profile(_mlp())
    n = profile.num_segments
    half = SegmentTimes((0.004,) * n, (0.008,) * n, 0.0006, 0.001, "half the host's speed")
    profile = profile.with_times("G0", profile.times["host"]).with_times("G1", half)
    speeds = measured_cluster(cluster, profile).device_types
    assert speeds["G0"].measured_speed == pytest.approx(1.0) and speeds["G1"].measured_speed == pytest.approx(0.5)
    planned = plan(profile, cluster, PlanRequest.asked(policy="hd", vw_size=2))
    assert sorted(sorted(d.type.name for d in w.devices) for w in planned.workers) == [["G0", "G1"], ["G0", "G1"]]


def _file_cluster(tmp_path, accelerator):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({
        "name": "file", "device_types": {"A": {"memory": "40G", **accelerator}},
        "nodes": [{"name": "box", "device_type": "A", "count": 2}],
        "links": {"intra_node_GBps": 15.75, "inter_node_GBps": 7}}))
    return str(path)


def test_a_cluster_files_accelerator_without_peak_is_measured_where_the_device_is(tmp_path, monkeypatch):
    cluster = load_cluster(_file_cluster(tmp_path, {"device_name": "Tesla T4"}))
    assert cluster.device_types["A"].measured and cluster.device_types["A"].peak_tflops is None
    model = _mlp()
    with pytest.raises(ClusterError, match="its speed is measured on a device named 'Tesla T4' of this machine, "
                                           "which has no GPU: plan on a machine with the device, give the type "
                                           "peak_tflops"):
        discovery.with_device_speeds(_profile(model), model, _sample, cluster, LOSS)
    monkeypatch.setattr(discovery, "physical_devices", _fake_listing)
    profile = discovery.with_device_speeds(_profile(model), model, _sample, cluster, LOSS)
    assert plan(profile, cluster, PlanRequest.asked(policy="ed")).workers


def test_a_cluster_files_accelerator_with_neither_peak_nor_device_name_is_refused_at_load(tmp_path):
    with pytest.raises(ClusterError, match="give peak_tflops and memory_bandwidth_GBps .*, device_name"):
        load_cluster(_file_cluster(tmp_path, {"label": "a GPU"}))
    with pytest.raises(ClusterError, match="device_name is the name TensorFlow gives a real accelerator"):
        load_cluster(_file_cluster(tmp_path, {"device_name": "x", "host_cpu": True}))


def test_discovery_is_refused_under_tf_config_with_the_remedy():
    with pytest.raises(ClusterError, match="under launch='tf_config' the tasks run on other machines.*describe "
                                           "them in a cluster file"):
        HetPipeStrategy(cluster="discover", launch="tf_config")
    with pytest.raises(ClusterError, match="resolve it with hetpipe_tf.runtime.discovery.cluster_for"):
        load_cluster("discover")


def test_the_strategy_takes_the_discovered_cluster():
    strategy = HetPipeStrategy(cluster="discover", launch="in_process")
    assert strategy.cluster.discovered and strategy.cluster.device_types["CPU"].host_cpu


def test_plan_auto_takes_the_host_cpu_and_gpus_as_real_devices(monkeypatch):
    specs = parse_devices("cpu,1@32M,cpu")
    with pytest.raises(ClusterError, match="host CPU is a real device"):
        from_device_specs(specs)
    cluster = from_device_specs(specs, real=discovery.spec_device_type)
    assert [(n.device_type, n.count) for n in cluster.nodes] == [("CPU0", 2), ("E1", 1)]
    assert cluster.device_types["CPU0"].host_cpu
    assert [d.type.name for d in cluster.devices_in_spec_order(specs, discovery.spec_device_type)] == [
        "CPU0", "E1", "CPU0"]
    planned = plan(_profile(_mlp()), cluster, PlanRequest.asked(workers=(tuple(cluster.devices()),)))
    assert len(planned.workers) == 1 and len(planned.workers[0].devices) == 3
    monkeypatch.setattr(discovery, "physical_devices", _fake_listing)
    gpus = from_device_specs(parse_devices("gpu:0,gpu:2,gpu:1@8G"), real=discovery.spec_device_type)
    assert [(n.device_type, n.count) for n in gpus.nodes] == [("G0", 1), ("G1", 1), ("G2", 1)]
    assert gpus.device_types["G2"].memory == 8 * GiB and gpus.device_types["G1"].device_name == "Tesla T4"


def test_hetpipe_plan_discover_runs_end_to_end(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hetpipe_tf.cli.hetpipe", "plan", "--cluster=discover",
                           "--model=mlp", "--batch_size=16"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    out, status = done.stdout, done.stderr  # what was found and measured goes to stderr, beside the plan
    assert "discovered on this machine: 1x host CPU" in status and "no GPU" in status
    assert "hetpipe: CPU: speed 1.000 against the host CPU" in status
    assert "cluster 'discover': 1x host CPU" in out and "predicted" in out


def test_hetpipe_train_plan_auto_plans_and_trains_on_the_host_cpu_beside_an_emulated_device(tmp_path):
    run = hetpipe_train(tmp_path, "--plan=auto", "--epochs=1", "--steps_per_epoch=4", "--devices=cpu,0.5@64M",
                        "--model=mlp", "--dilation=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "policy GIVEN" in run.stdout and "predicted" in run.stdout
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert sorted(summary["devices"]) == ["emulated device (speed 0.5, memory 64.0 MiB)", "host CPU"]
