"""A worker task's task starter: the chief starts processes on another host through it."""
import multiprocessing
import os
import threading
import time

import pytest

from hetpipe_tf.distributed.launch import ClusterConfigError, TFConfigCluster
from hetpipe_tf.distributed.starter import (AUTHKEY_ENV, ClusterStartError, StarterClient, TaskStarter,
                                            authkey_from, starter_file)
from tests.helpers.processes import wait_until_gone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK = "tests.distributed.ready_task"


@pytest.fixture
def starter(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the task module is found from the repository's root
    key = os.urandom(16)
    task_address = f"127.0.0.1:{os.getpid()}"
    started = TaskStarter("127.0.0.1", key, str(tmp_path)).start(task_address)
    yield started, key, task_address
    started.close()
    os.remove(starter_file(task_address))
    deadline = time.monotonic() + 10  # its threads end: tests after this one check for leftover ones
    while any(t.name.startswith("hetpipe-starter") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name.startswith("hetpipe-starter") for t in threading.enumerate())


def test_the_chief_starts_and_ends_a_process_through_a_worker_tasks_starter(starter, tmp_path):
    started, key, task_address = starter
    with open(starter_file(task_address)) as f:
        assert f.read() == started.address  # what the chief reads through TensorFlow
    client = StarterClient(started.address, key, timeout_s=10)
    address, heartbeat, pid = client.start("vw0", 0, TASK, [], chief_timeout_s=0, start_timeout_s=60)
    client.close()
    client = StarterClient(started.address, key, timeout_s=10)  # a chief may connect again
    assert address.startswith("127.0.0.1:") and heartbeat.startswith("127.0.0.1:")
    with open(f"/proc/{pid}/stat") as f:
        assert int(f.read().split(")")[-1].split()[1]) == os.getpid()  # the starter's own child
    assert f"ready at {address}" in (tmp_path / "vw0-0.log").read_text()
    client.end("vw0", 0)
    client.close()
    assert not wait_until_gone([pid], 10)


def test_a_process_that_fails_to_start_is_reported_with_its_log(starter):
    started, key, _ = starter
    client = StarterClient(started.address, key, timeout_s=10)
    with pytest.raises(ClusterStartError, match=r"(?s)task vw1:0 exited with 3; its log .*failing as asked"):
        client.start("vw1", 0, TASK, ["--fail"], chief_timeout_s=0, start_timeout_s=60)
    client.close()


def test_a_starter_refuses_a_chief_without_the_clusters_key(starter):
    started, _, _ = starter
    with pytest.raises(multiprocessing.AuthenticationError):
        StarterClient(started.address, os.urandom(16), timeout_s=10)


def test_tf_config_that_does_not_fit_the_cluster_is_named():
    with pytest.raises(ClusterConfigError, match="launch='tf_config' needs TF_CONFIG"):
        TFConfigCluster(1, 1, environ={})
    with pytest.raises(ClusterConfigError, match="TF_CONFIG is not a JSON object with a 'cluster'"):
        TFConfigCluster(1, 1, environ={"TF_CONFIG": "{ps: 1}"})
    config = '{"cluster": {"ps": ["a:1"], "worker": ["a:2"], "chief": ["a:3"]}, "task": {"type": "%s"}}'
    with pytest.raises(ClusterConfigError, match=r"has \{'ps': 1, 'worker': 1, 'chief': 1\} tasks; this cluster "
                                                 r"description needs \{'ps': 2, 'worker': 2, 'chief': 1\}"):
        TFConfigCluster(2, 2, environ={"TF_CONFIG": config % "chief"})
    with pytest.raises(ClusterConfigError, match="this process must be TF_CONFIG's chief"):
        TFConfigCluster(1, 1, environ={"TF_CONFIG": config % "worker"})


def test_the_cluster_key_must_be_hex_and_tf_config_needs_it():
    assert authkey_from({AUTHKEY_ENV: "00ff"}) == b"\x00\xff" and authkey_from({}) is None
    with pytest.raises(ValueError, match=f"{AUTHKEY_ENV} must be hex"):
        authkey_from({AUTHKEY_ENV: "not hex"})
    config = '{"cluster": {"ps": ["a:1"], "worker": ["a:2"], "chief": ["a:3"]}, "task": {"type": "chief"}}'
    with pytest.raises(ClusterConfigError, match=f"needs the cluster's key in {AUTHKEY_ENV}"):
        TFConfigCluster(1, 1, environ={"TF_CONFIG": config})
    cluster = TFConfigCluster(1, 1, environ={"TF_CONFIG": config, AUTHKEY_ENV: "00ff"})
    assert cluster.address("worker", 0) == "a:2" and cluster.authkey == b"\x00\xff"

