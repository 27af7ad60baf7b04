"""Mixed GPUs of one machine launched as the emulated cluster is (hetpipe_tf.distributed.gpus), through
its one seam: HETPIPE_FAKE_GPUS names a listing that this process and its children read in place of
TensorFlow's. What every task and process is given (environment, server flags, device names), a plan on
two GPU types, and every refusal; the TensorFlow listing itself runs for real (it finds no GPU here)."""
import json
import os
import subprocess
import sys

import pytest

from hetpipe_tf.distributed.cluster_devices import ClusterDevices
from hetpipe_tf.distributed.gpus import (
    FAKE_GPUS_ENV,
    NO_GPU,
    PhysicalGPU,
    gpu_layout,
    physical_gpus,
    server_config,
)
from hetpipe_tf.distributed.launch import ClusterConfigError, LocalCluster
from hetpipe_tf.planning.cluster import ClusterError, load_cluster
from hetpipe_tf.planning.planner import plan
from hetpipe_tf.planning.request import PlanRequest
from tests.helpers.gpus import LISTING, mixed
from tests.helpers.profiles import model_profile

GiB = 1024 ** 3

@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    """This machine as the four GPUs of LISTING, for this process and every process it starts."""
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(LISTING))
    monkeypatch.setenv(FAKE_GPUS_ENV, str(path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return path


def test_the_listing_is_the_fake_here_and_in_a_child_process(fake_gpus):
    here = physical_gpus()
    assert here[2] == PhysicalGPU(2, "NVIDIA TITAN V", int(11.5 * GiB), (7, 0))
    child = subprocess.run([sys.executable, "-c", ("from hetpipe_tf.distributed.gpus import physical_gpus; "
                                                  "print(repr(physical_gpus()))")], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=os.getcwd()), check=True)
    assert child.stdout.strip() == repr(here)


def test_tensorflow_lists_the_gpus_the_machine_has(monkeypatch):
    """The seam's own path (TensorFlow in a child process): none without a GPU device file; with
    one, GPUs numbered from 0 as TensorFlow numbers them."""
    monkeypatch.delenv(FAKE_GPUS_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    listed = physical_gpus()
    if os.path.exists("/dev/nvidia0"):
        assert [g.index for g in listed] == list(range(len(listed))) and listed
    else:
        assert listed == ()


def test_each_worker_task_sees_its_nodes_gpus_and_every_other_task_none(fake_gpus, tmp_path):
    cluster = load_cluster(mixed(v_gpus=(2, 3)))  # node-G names none: it takes the free 0 and 1
    layout = gpu_layout(cluster)
    local = LocalCluster(num_ps=2, worker_cpus=[2, 2], log_dir=str(tmp_path), gpus=layout)
    commands = {(c.job, c.index): c for c in local.task_commands()}
    assert commands[("worker", 0)].env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert commands[("worker", 1)].env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    # Each GPU's limit: the type's memory (8G for V), or the GPU's own where smaller (5.5G of 6G for G).
    assert "--gpu_memory_mb=8192,8192" in commands[("worker", 0)].args
    assert "--gpu_memory_mb=5632,5632" in commands[("worker", 1)].args
    assert commands[("ps", 0)].env == commands[("ps", 1)].env == NO_GPU
    assert not any(a.startswith("--gpu_memory_mb") for a in commands[("ps", 0)].args)
    assert local.added_task_env() == NO_GPU  # the virtual workers' processes
    assert "its limit is the GPU's" in layout.describe() and "node 'node-G'" in layout.describe()
    # Inside its task a node's GPUs are GPU:0 and GPU:1, in the node's order.
    devices = ClusterDevices(cluster, "processes")
    assert [devices.device(d) for d in cluster.devices()] == [
        "/job:worker/task:0/device:GPU:0", "/job:worker/task:0/device:GPU:1",
        "/job:worker/task:1/device:GPU:0", "/job:worker/task:1/device:GPU:1"]


def test_nodes_that_name_no_gpus_take_the_next_free_ones_in_file_order(fake_gpus):
    spec = mixed(v_gpus=(0, 1))
    spec["nodes"].append({"name": "node-G2", "device_type": "G", "count": 1, "gpus": [3]})
    spec["nodes"][1]["count"] = 1  # node-G names none: the lowest index that no node names
    assert [n.indices for n in gpu_layout(load_cluster(spec)).nodes] == [(0, 1), (2,), (3,)]
    spec = mixed(v_gpus=(2, 3))
    spec["nodes"][0].pop("gpus")
    layout = gpu_layout(load_cluster(spec))  # neither names any: 0, 1 to node-V; 2, 3 to node-G
    assert [n.indices for n in layout.nodes] == [(0, 1), (2, 3)]


def test_an_emulated_cluster_lists_no_gpu_and_hides_them_from_every_task(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_GPUS_ENV, str(tmp_path / "not-read.json"))  # would fail if read
    layout = gpu_layout(load_cluster("local"))
    assert not layout.has_gpus and layout.worker_env(0) == NO_GPU and layout.worker_args(0) == []


def test_pinned_gpus_are_positions_in_the_schedulers_list(fake_gpus):
    layout = gpu_layout(load_cluster(mixed(v_gpus=(2, 3), g_gpus=(0, 1))),
                        environ={FAKE_GPUS_ENV: str(fake_gpus), "CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [n.visible for n in layout.nodes] == ["6,7", "4,5"]
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7 was set (a scheduler pinned these GPUs)" in layout.describe()


def test_a_plan_on_two_gpu_types_puts_every_stage_on_its_nodes_renumbered_gpus(fake_gpus):
    cluster = load_cluster(mixed(v_gpus=(3, 2), g_gpus=(0, 1)))
    layout = gpu_layout(cluster)
    chosen = plan(model_profile(n=6), cluster, PlanRequest(policy="hd", max_num_in_flight=2))
    devices = ClusterDevices(cluster, "processes")
    nodes = [n.name for n in cluster.nodes]
    placed = 0
    for w, worker in enumerate(chosen.workers):
        spec, local = devices.worker(w, worker.devices, chosen.node_boundaries(w))
        assert local == 0  # a virtual worker's process holds no GPU: every stage is on a worker task
        for device, name in zip(worker.devices, spec.tf_devices, strict=True):
            node = nodes.index(device.node)
            assert name == f"/job:worker/task:{node}/device:GPU:{device.index}"
            physical = layout.nodes[node].indices[device.index]  # what CUDA_VISIBLE_DEVICES shows as that GPU
            assert layout.gpus[physical].name == {"V": "NVIDIA TITAN V", "G": "NVIDIA GeForce RTX 2060"}[
                device.type.name]
            placed += 1
    assert placed == 4  # HD: each worker one V and one G


def test_the_worker_tasks_server_grows_each_gpus_memory_up_to_its_limit():
    config = server_config(2, 1, [8192, 5632])
    assert config.gpu_options.allow_growth
    assert [list(v.memory_limit_mb) for v in config.gpu_options.experimental.virtual_devices] == [[8192], [5632]]
    assert not server_config(2, 1, []).gpu_options.experimental.virtual_devices


REFUSALS = [
    (mixed(v_gpus=(2, 5)), None, (r"node 'node-V' names GPU 5, which this machine does not have; TensorFlow lists "
                                  r"4 GPU\(s\) here: GPU 0: NVIDIA GeForce RTX 2060")),
    (mixed(v_gpus=(2, 3), g_gpus=(3, 0)), "file", r"GPU 3 is in two nodes, 'node-V' and 'node-G'"),
    (mixed(v_gpus=(1, 2, 3)), "file", r"node 0 \('node-V'\): gpus \[1, 2, 3\] names 3 GPUs, more than its count of 2"),
    (mixed(v_gpus=(2, 2)), "file", r"gpus \[2, 2\] names a GPU more than once"),
    (mixed(v_gpus=("a", 1)), "file", r"gpus is a list of GPU indices of this machine \(integers >= 0\), got \['a', "),
    (mixed(v_gpus=(0, 1), g_gpus=None, count=3), None,
     r"node 'node-G' \(3 devices of type 'G'\) names no gpus and takes the next free ones, but 2 are left \(\[2, 3"),
    (mixed(v_gpus=(0, 2)), None, r"node 'node-V' has GPUs \[0, 2\] of 2 kinds"),
]


@pytest.mark.parametrize("spec,when,message", REFUSALS, ids=["no such index", "in two nodes", "more than count",
                                                              "twice in a node", "not an index", "none left",
                                                              "two kinds"])
def test_what_cannot_be_served_is_refused_by_name(fake_gpus, spec, when, message):
    """`when` "file": refused as the file loads, before any listing; else by the layout on this machine's GPUs."""
    if when == "file":
        with pytest.raises(ClusterError, match=message):
            load_cluster(spec)
        return
    cluster = load_cluster(spec)
    with pytest.raises(ClusterError, match=message):
        gpu_layout(cluster)


@pytest.mark.parametrize("device_type,kind", [({"host_cpu": True, "memory": "1G"}, "the host CPU"),
                                              ({"emulated_speed": 0.5, "memory": "1G"}, "emulated")])
def test_a_gpu_index_on_a_node_this_hosts_cpu_serves_is_refused(device_type, kind):
    spec = mixed()
    spec["device_types"]["V"] = device_type
    with pytest.raises(ClusterError, match=f"node 0 \\('node-V'\\): gpus \\[2, 3\\] names GPUs, but its device type "
                                           f"'V' is {kind}"):
        load_cluster(spec)


def test_no_gpu_at_all_says_so_with_the_likely_cause(tmp_path, monkeypatch):
    (tmp_path / "none.json").write_text("[]")
    monkeypatch.setenv(FAKE_GPUS_ENV, str(tmp_path / "none.json"))
    with pytest.raises(ClusterError, match=r"TensorFlow lists 0 GPU\(s\) here: none \(is tensorflow-cpu installed"):
        gpu_layout(load_cluster(mixed()))


def test_a_malformed_fake_listing_is_named(tmp_path, monkeypatch):
    (tmp_path / "bad.json").write_text('[{"index": 0, "name": "x"}]')
    monkeypatch.setenv(FAKE_GPUS_ENV, str(tmp_path / "bad.json"))
    with pytest.raises(ClusterError, match=r"HETPIPE_FAKE_GPUS=.*bad.json: GPU 0 of the listing is not"):
        physical_gpus()


def test_the_strategy_checks_the_gpus_for_launch_processes_and_refuses_them_in_process(fake_gpus):
    from hetpipe_tf.api.strategy import HetPipeStrategy

    HetPipeStrategy(cluster=mixed(), launch="processes")  # accepted: nothing starts before scope()
    with pytest.raises(ClusterError, match="node 'node-V' names GPU 5"):
        HetPipeStrategy(cluster=mixed(v_gpus=(2, 5)), launch="processes")
    with pytest.raises(ClusterConfigError, match="launch='in_process' serves emulated devices and the host CPU only"):
        HetPipeStrategy(cluster=mixed(), launch="in_process")


def test_hetpipe_train_with_a_gpu_cluster_file_takes_the_strategys_path(fake_gpus, tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(mixed(v_gpus=(2, 7))))
    run = subprocess.run([sys.executable, "-m", "hetpipe_tf.cli.train", f"--cluster={path}", "--epochs=1",
                          "--steps_per_epoch=1"], check=False, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert run.returncode == 2, run.stderr[-3000:]
    assert "hetpipe-train: error: cluster 'workstation': node 'node-V' names GPU 7, which this machine does not have" \
           in run.stderr


def test_started_tasks_run_with_their_gpus_and_the_server_takes_its_memory_limits(fake_gpus, tmp_path):
    """The tasks as processes: each one's environment as the kernel holds it, and the worker task's
    server started with its GPUs' limits (TensorFlow finds none of them here: CPU only)."""
    spec = mixed(v_gpus=(3, 2))
    spec["nodes"] = spec["nodes"][:1]
    cluster = load_cluster(spec)
    local = LocalCluster(num_ps=1, worker_cpus=[2], log_dir=str(tmp_path), gpus=gpu_layout(cluster)).start()
    try:
        def environ(job):
            with open(f"/proc/{local.pid(job, 0)}/environ", "rb") as f:
                pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
            return {k.decode(): v.decode() for k, v in pairs}

        assert environ("worker")["CUDA_VISIBLE_DEVICES"] == "3,2"
        assert environ("ps")["CUDA_VISIBLE_DEVICES"] == ""
        assert environ("worker")[FAKE_GPUS_ENV] == str(fake_gpus)  # the tasks read the same listing
        with open(f"/proc/{local.pid('worker', 0)}/cmdline", "rb") as f:
            assert b"--gpu_memory_mb=8192,8192" in f.read().split(b"\0")
        assert local.exit_status("worker", 0) is None  # ready, and still serving
    finally:
        local.stop()


def test_the_mixed_gpus_examples_cluster_maps_onto_a_machine_of_those_gpus(tmp_path, monkeypatch):
    """examples/mixed_gpus is not run here (it needs the GPUs); its cluster file is checked against a
    fake listing of the machine it describes, and its script compiles."""
    import py_compile

    listing = [dict(g, index=i) for i, g in enumerate(LISTING[2:] + LISTING[:2])]  # TITAN Vs first
    (tmp_path / "gpus.json").write_text(json.dumps(listing))
    monkeypatch.setenv(FAKE_GPUS_ENV, str(tmp_path / "gpus.json"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "mixed_gpus")
    cluster = load_cluster(os.path.join(example, "cluster.json"))
    layout = gpu_layout(cluster)
    assert [n.visible for n in layout.nodes] == ["0,1", "2,3"]
    assert [layout.gpus[n.indices[0]].name for n in layout.nodes] == ["NVIDIA TITAN V", "NVIDIA GeForce RTX 2060"]
    py_compile.compile(os.path.join(example, "train.py"), cfile=str(tmp_path / "train.pyc"), doraise=True)
