"""TensorFlow's cluster resolvers as a hetpipe_tf cluster (hetpipe_tf/distributed/resolvers.py).

The examples' environments are resolved as each of their tasks would resolve them, and the chief's
view is the TFConfigCluster it joins:

* the Slurm batch script (examples/slurm/hetpipe_two_nodes.sbatch) runs under bash with a fake
  ``scontrol`` (it lists the allocation's hosts) and a fake ``srun`` (it records its command and
  SLURM_HOSTFILE) on PATH, the seam where Slurm itself would be; each task's SLURM_* variables are
  those of Slurm's arbitrary distribution over that hostfile, and TensorFlow's SlurmClusterResolver
  reads them;
* the TFJob manifest (examples/kubernetes/tfjob.yaml) gives each pod the TF_CONFIG that the training
  operator sets (its replicas, its service names, its port), and TensorFlow's TFConfigClusterResolver
  reads it;
* KubernetesClusterResolver takes a client listing pods (its own ``override_client`` seam).

Every task must run where its node is (worker task i on node i's host), run its server or the chief's
command, and the chief must see the resolver's cluster. A resolver whose tasks do not fit the
description, or that names this process another task, is refused with what it gave and the fix.
"""
import json
import os
import stat
import subprocess
import sys
import types

import pytest
import tensorflow as tf
import yaml

from hetpipe_tf.distributed import resolvers
from hetpipe_tf.distributed.launch import TFConfigCluster
from hetpipe_tf.planning.cluster import load_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TWO_NODES = os.path.join(ROOT, "examples", "slurm", "two_nodes.json")
AUTHKEY = "00" * 16


@pytest.fixture
def two_nodes():
    return load_cluster(TWO_NODES)


def _script(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_batch_script(tmp_path, hostlist):
    """Runs the Slurm batch script as sbatch would on the allocation's first host; what srun was given
    (its arguments and the hostfile's lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "scontrol", "#!/usr/bin/env bash\n"
            '[ "$1 $2" = "show hostnames" ] || exit 1\n'
            f"printf '%s\\n' {' '.join(hostlist)}\n")
    record = tmp_path / "srun.json"
    _script(bin_dir / "srun", f"#!{sys.executable}\n"
            "import json, os, sys\n"
            f"json.dump({{'argv': sys.argv[1:], 'hosts': open(os.environ['SLURM_HOSTFILE']).read().split(),\n"
            f"           'authkey': os.environ['HETPIPE_AUTHKEY']}}, open({str(record)!r}, 'w'))\n")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu[01-02]",
               SLURM_SUBMIT_DIR=os.path.dirname(TWO_NODES), PYTHON=sys.executable)
    subprocess.run(["bash", os.path.join(ROOT, "examples", "slurm", "hetpipe_two_nodes.sbatch")], env=env,
                   check=True, timeout=60)
    return json.loads(record.read_text())


def slurm_task_environ(hosts, rank):
    """The SLURM_* variables of task `rank` of a step whose tasks run on `hosts` (one per task, as
    --distribution=arbitrary lays them out)."""
    nodes = list(dict.fromkeys(hosts))
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(len(hosts)),
            "SLURM_STEP_NODELIST": ",".join(nodes),
            "SLURM_STEP_TASKS_PER_NODE": ",".join(str(hosts.count(n)) for n in nodes)}


def test_the_slurm_batch_script_runs_every_task_on_its_node(tmp_path, monkeypatch, two_nodes):
    srun = run_batch_script(tmp_path, ["gpu02", "gpu01"])
    hosts = srun["hosts"]
    split = srun["argv"].index("--")
    assert srun["argv"][:split] == ["--ntasks=5", "--distribution=arbitrary", sys.executable, "-m",
                                    "hetpipe_tf.distributed.resolvers", "--resolver=slurm", f"--cluster={TWO_NODES}"]
    chief_command = srun["argv"][split + 1:]
    assert chief_command[:3] == ["hetpipe-train", f"--cluster={TWO_NODES}", "--launch=tf_config"]
    assert len(srun["authkey"]) == 32
    seen = {}
    for rank in range(len(hosts)):
        for name, value in slurm_task_environ(hosts, rank).items():
            monkeypatch.setenv(name, value)
        resolved = resolvers.resolve(resolvers.make_resolver("slurm", two_nodes), two_nodes)
        address = resolved.spec[resolved.task_type][resolved.task_id]
        assert address.rsplit(":", 1)[0] == hosts[rank], f"rank {rank} runs on {hosts[rank]}, its task at {address}"
        command, env = resolvers.task_command(resolved, two_nodes, chief_command)
        seen[(resolved.task_type, resolved.task_id)] = (hosts[rank], command, env)
    assert sorted(seen) == [("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
    assert [seen[("worker", i)][0] for i in (0, 1)] == ["gpu01", "gpu02"]  # node i on the i-th host in sorted order
    assert seen[("chief", 0)][1] == chief_command
    host, command, env = seen[("worker", 1)]
    assert command[1:3] == ["-m", "hetpipe_tf.distributed.server"]
    assert command[4:] == ["--job_name=worker", "--task_index=1", "--logical_cpus=1"]  # GPUs are found as they are
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert seen[("ps", 1)][2]["CUDA_VISIBLE_DEVICES"] == ""  # a ps task keeps its weights on its CPU
    # The chief's view: the cluster it joins is the resolver's.
    spec = json.loads(env["TF_CONFIG"])["cluster"]
    chief = TFConfigCluster(2, 2, environ={"TF_CONFIG": seen[("chief", 0)][2]["TF_CONFIG"], "HETPIPE_AUTHKEY": AUTHKEY})
    assert chief.spec == spec
    assert [chief.host(i) for i in (0, 1)] == ["gpu01", "gpu02"]


def tfjob_pods(manifest):
    """Each pod of a TFJob with the TF_CONFIG the training operator sets in it: the cluster of every
    replica's service addresses, the pod's task; and the pod's command."""
    name, replicas = manifest["metadata"]["name"], manifest["spec"]["tfReplicaSpecs"]
    cluster = {}
    for kind, spec in replicas.items():
        port = spec["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
        cluster[kind.lower()] = [f"{name}-{kind.lower()}-{i}.default.svc:{port}" for i in range(spec["replicas"])]
    for kind, spec in replicas.items():
        for i in range(spec["replicas"]):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": kind.lower(), "index": i}})
            yield tf_config, spec["template"]["spec"]["containers"][0]["command"]


def test_the_tfjob_manifest_runs_every_pod_as_its_task(monkeypatch, two_nodes):
    with open(os.path.join(ROOT, "examples", "kubernetes", "tfjob.yaml")) as f:
        manifest = yaml.safe_load(f)
    assert manifest["kind"] == "TFJob"
    seen = {}
    for tf_config, command in tfjob_pods(manifest):
        assert command[:4] == ["python", "-m", "hetpipe_tf.distributed.resolvers", "--resolver=tf_config"]
        split = command.index("--")
        cluster_file = command[4].split("=", 1)[1]
        assert os.path.basename(cluster_file) == "two_nodes.json"  # the ConfigMap's key
        monkeypatch.setenv("TF_CONFIG", tf_config)
        resolved = resolvers.resolve(resolvers.make_resolver("tf_config", two_nodes), two_nodes)
        seen[(resolved.task_type, resolved.task_id)] = resolvers.task_command(resolved, two_nodes,
                                                                              command[split + 1:])
    assert sorted(seen) == [("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
    assert seen[("chief", 0)][0][:3] == ["hetpipe-train", "--cluster=/etc/hetpipe/two_nodes.json",
                                         "--launch=tf_config"]
    command, env = seen[("worker", 0)]
    assert command[4:] == ["--job_name=worker", "--task_index=0", "--logical_cpus=1"]
    chief = TFConfigCluster(2, 2, environ={"TF_CONFIG": seen[("chief", 0)][1]["TF_CONFIG"], "HETPIPE_AUTHKEY": AUTHKEY})
    assert chief.spec["worker"] == ["hetpipe-two-nodes-worker-0.default.svc:2222",
                                    "hetpipe-two-nodes-worker-1.default.svc:2222"]
    assert chief.spec["ps"] == ["hetpipe-two-nodes-ps-0.default.svc:2222", "hetpipe-two-nodes-ps-1.default.svc:2222"]


class PodLister:
    """A Kubernetes client's pod listing (KubernetesClusterResolver's override_client): the running
    pods whose labels match a selector."""

    def __init__(self, pods):
        self.pods = pods  # [(name, labels, host_ip)]

    def list_pod_for_all_namespaces(self, label_selector):
        wanted = dict(part.split("=") for part in label_selector.split(","))
        return types.SimpleNamespace(items=[
            types.SimpleNamespace(metadata=types.SimpleNamespace(name=name),
                                  status=types.SimpleNamespace(phase="Running", host_ip=ip))
            for name, labels, ip in self.pods if wanted.items() <= labels.items()])


def test_a_kubernetes_resolver_makes_this_process_the_chief(monkeypatch, two_nodes):
    pods = [(f"job-{role}-{i}", {"role": role}, f"10.0.{i}.{n}") for n, role in enumerate(("chief", "ps", "worker"))
            for i in range(1 if role == "chief" else 2)]
    resolver = tf.distribute.cluster_resolver.KubernetesClusterResolver(
        {role: [f"role={role}"] for role in ("chief", "ps", "worker")}, override_client=PodLister(pods))
    resolved = resolvers.resolve(resolver, two_nodes)
    assert (resolved.task_type, resolved.task_id) == ("chief", 0)
    assert resolved.spec["worker"] == ("10.0.0.2:8470", "10.0.1.2:8470")
    environ = resolvers.chief_environ(resolver, two_nodes, {"HETPIPE_AUTHKEY": AUTHKEY})
    assert TFConfigCluster(2, 2, environ=environ).spec["ps"] == ["10.0.0.1:8470", "10.0.1.1:8470"]
    assert "node 1 (node-Q): worker task 10.0.1.2:8470, ps task 10.0.1.1:8470" in resolved.describe()


def _tf_config(monkeypatch, workers, task):
    spec = {"chief": ["h0:1"], "ps": [f"h{i}:2" for i in range(workers)], "worker": [f"h{i}:3" for i in range(workers)]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": task}))
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def test_a_resolver_whose_tasks_do_not_fit_the_nodes_is_refused(monkeypatch, two_nodes):
    resolver = _tf_config(monkeypatch, 3, {"type": "chief", "index": 0})
    with pytest.raises(resolvers.ResolverError, match=r"TFConfigClusterResolver resolves the tasks \{'chief': 1, "
                                                      r"'ps': 3, 'worker': 3\}; cluster 'two-nodes' \(2 nodes\) needs "
                                                      r"\{'chief': 1, 'ps': 2, 'worker': 2\}.*task i is node i"):
        resolvers.resolve(resolver, two_nodes)


def test_a_resolver_with_a_gap_in_its_tasks_is_refused(two_nodes):
    spec = tf.train.ClusterSpec({"chief": ["h0:1"], "ps": ["h0:2", "h1:2"], "worker": {0: "h0:3", 2: "h1:3"}})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="chief", task_id=0)
    with pytest.raises(resolvers.ResolverError, match=r"job 'worker' has tasks \[0, 2\]; hetpipe_tf needs them "
                                                      r"numbered 0..1"):
        resolvers.resolve(resolver, two_nodes)


def test_a_resolver_naming_this_process_a_worker_is_refused_in_the_chief(monkeypatch, two_nodes):
    resolver = _tf_config(monkeypatch, 2, {"type": "worker", "index": 1})
    with pytest.raises(resolvers.ResolverError, match="names this process task worker:1; HetPipeStrategy runs in the "
                                                      "chief.*python -m hetpipe_tf.distributed.resolvers"):
        resolvers.chief_environ(resolver, two_nodes)


def test_the_chief_without_its_command_is_refused(monkeypatch, two_nodes):
    resolver = _tf_config(monkeypatch, 2, {"type": "chief", "index": 0})
    with pytest.raises(resolvers.ResolverError, match="give the chief's command after --"):
        resolvers.task_command(resolvers.resolve(resolver, two_nodes), two_nodes, [])


def test_slurm_outside_a_step_and_unknown_resolvers_are_refused(monkeypatch, two_nodes):
    monkeypatch.delenv("SLURM_STEP_TASKS_PER_NODE", raising=False)
    with pytest.raises(resolvers.ResolverError, match="SLURM_STEP_TASKS_PER_NODE, which is not set: run under `srun`"):
        resolvers.make_resolver("slurm", two_nodes)
    with pytest.raises(resolvers.ResolverError, match=r"unknown resolver 'mpi'; allowed: tf_config, slurm"):
        resolvers.make_resolver("mpi", two_nodes)


def test_the_strategy_takes_a_resolver_as_launch_tf_config(monkeypatch, two_nodes):
    from hetpipe_tf import HetPipeStrategy

    resolver = _tf_config(monkeypatch, 2, {"type": "chief", "index": 0})
    strategy = HetPipeStrategy(cluster=TWO_NODES, cluster_resolver=resolver)  # GPUs: not launch="processes"
    assert (strategy.launch, strategy.cluster_resolver) == ("tf_config", resolver)
    with pytest.raises(resolvers.ResolverError, match="launch='in_process' runs none"):
        HetPipeStrategy(cluster=TWO_NODES, cluster_resolver=resolver, launch="in_process")


def _loopback_tasks(workers):
    """A loopback cluster of free ports: {job: [address, ...]} with a chief, and `workers` ps and
    worker tasks."""
    from hetpipe_tf.distributed.ports import free_port

    return {"chief": [f"127.0.0.1:{free_port()}"], "ps": [f"127.0.0.1:{free_port()}" for _ in range(workers)],
            "worker": [f"127.0.0.1:{free_port()}" for _ in range(workers)]}


def _start_task(spec, job, index, log_path, chief_command=()):
    """`python -m hetpipe_tf.distributed.resolvers --resolver=tf_config` as task (job, index) of
    `spec`, its output in `log_path`."""
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": job, "index": index}}),
               HETPIPE_AUTHKEY=AUTHKEY, TF_CPP_MIN_LOG_LEVEL="2")
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "hetpipe_tf.distributed.resolvers", "--resolver=tf_config",
                                 "--cluster=local", "--", *chief_command], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def test_a_worker_task_run_through_the_entry_point_becomes_its_server(tmp_path):
    from hetpipe_tf.distributed.starter import wait_ready

    spec = _loopback_tasks(2)
    log = tmp_path / "worker-1.log"
    proc = _start_task(spec, "worker", 1, log)
    try:
        wait_ready(proc, str(log), "worker:1", 120)
        text = log.read_text()
        assert f"hetpipe_tf server worker:1 (pid {proc.pid}) ready" in text  # the same process, its server now
        assert "this process is worker:1" in text and f"node 1 (host-S): worker task {spec['worker'][1]}" in text
    finally:
        proc.kill()
        proc.wait()


_CHIEF = """
import json, keras, tensorflow as tf, hetpipe_tf
from hetpipe_tf.cli.models import build_model
from hetpipe_tf.data.datasets import load_image_classification

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = hetpipe_tf.HetPipeStrategy(cluster="local", cluster_resolver=resolver, dilation=1.0, timeout_s=120)
with strategy.scope():
    train = load_image_classification("hetpipe_digits", "train", batch_size=32, shuffle=True)
    model = build_model("cnn", input_shape=(8, 8, 1), num_classes=10)
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(train, epochs=1, steps_per_epoch=8, verbose=0)
print("RESULT " + json.dumps({"launch": strategy.launch, "loss": history.history["loss"],
                              "workers": len(strategy.plan.workers)}))
"""


@pytest.mark.slow
def test_a_strategy_given_a_resolver_trains_on_the_tasks_the_entry_point_started(tmp_path):
    """Every task of a two-node loopback cluster through the entry point (TF_CONFIG per task, as a
    TFJob sets it): the ps and worker tasks become their servers, the chief runs a script whose
    HetPipeStrategy takes TFConfigClusterResolver and trains an epoch on them. The CI subset covers
    the entry point's exec into a server (the test above) and the resolution of each task."""
    from hetpipe_tf.distributed.starter import wait_ready

    spec = _loopback_tasks(2)
    tasks = []
    try:
        for job in ("ps", "worker"):
            for i in range(2):
                log = tmp_path / f"{job}-{i}.log"
                tasks.append((_start_task(spec, job, i, log), str(log), f"{job}:{i}"))
        for proc, log, name in tasks:
            wait_ready(proc, log, name, 180)
        chief = _start_task(spec, "chief", 0, tmp_path / "chief.log", [sys.executable, "-c", _CHIEF])
        tasks.append((chief, str(tmp_path / "chief.log"), "chief"))
        assert chief.wait(timeout=600) == 0, (tmp_path / "chief.log").read_text()[-4000:]
    finally:
        for proc, *_ in tasks:
            proc.kill()
            proc.wait()
    lines = [line for line in (tmp_path / "chief.log").read_text().splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["launch"] == "tf_config" and result["workers"] == 2
    assert 0 < result["loss"][0] < 2.5
