"""CPU-quota groups: made with their quota and period, holding their node's worker task (and no
virtual worker's process), removed at the end and after a killed chief, refused where they cannot
be made.

These need cgroups this process can write (root, the cpu controller mounted): where they cannot be
written the tests that make groups are skipped, with the refusal's message as the reason."""
import os
import signal
import subprocess
import sys

import pytest

from hetpipe_tf.distributed import cgroups
from hetpipe_tf.distributed.cgroups import CgroupError, CpuGroups, find_cpu_controller, group_names
from hetpipe_tf.distributed.launch import LocalCluster
from tests.helpers.processes import wait_for, wait_until_gone
from tests.helpers.quota import needs_cgroups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(group, name):
    with open(os.path.join(group.path, name)) as f:
        return f.read().split()


def _quota_and_period(group):
    if group.controller.version == 1:
        return int(_read(group, "cpu.cfs_quota_us")[0]), int(_read(group, "cpu.cfs_period_us")[0])
    quota, period = _read(group, "cpu.max")
    return int(quota), int(period)


def _ready_task(index):
    return ("vw", index, 0 if index == 0 else 1, "tests.distributed.ready_task", [])


@needs_cgroups
def test_a_virtual_workers_process_runs_outside_every_quota_group_and_the_group_goes_at_the_end():
    """A process started at a quota node (a virtual worker's: the host's runtime, not a device's
    compute) runs where this process, the chief, runs: outside the node's group, which holds only
    the node's worker task (cluster.start(), the slow test below)."""
    controller = find_cpu_controller()
    cluster = LocalCluster(num_ps=2, worker_cpus=[1, 1], cpu_quotas=[0.3, None])
    try:
        group = cluster.cpu_group(0)
        cluster.start_tasks([_ready_task(0), _ready_task(1)])
        assert cluster.cpu_group(1) is None
        assert os.path.basename(group.path) == f"hetpipe-{os.getpid()}-node0"
        assert _quota_and_period(group) == (3000, 10_000)
        assert group.pids() == ()
        here = cgroups.current_group(controller, os.getpid())
        assert [cgroups.current_group(controller, cluster.pid("vw", i)) for i in (0, 1)] == [here, here]
    finally:
        cluster.stop()
    assert not os.path.exists(group.path)
    assert f"hetpipe-{os.getpid()}-node0" not in group_names(controller)


def test_a_quota_nodes_worker_task_starts_a_chiefs_process_in_the_host_group(tmp_path, monkeypatch):
    """Under hetpipe launch a virtual worker's process is started by its node's worker task, which
    runs in the node's group: the task's starter puts it in the group named by HOST_GROUP_ENV (its
    launcher's, outside every quota group) from its first instruction. A plain file stands in for
    the group's procs file."""
    from hetpipe_tf.distributed.starter import TaskStarter

    procs = tmp_path / "host.procs"
    procs.write_text("")
    monkeypatch.setenv(cgroups.HOST_GROUP_ENV, str(procs))
    starter = TaskStarter("127.0.0.1", b"k" * 16, str(tmp_path))
    answer = starter.handle("start", "vw", 0, "tests.distributed.ready_task", [], 0.0, 60.0)
    try:
        assert answer[0] == "started", answer
        assert procs.read_text().split() == [str(answer[3])]
    finally:
        starter.handle("end", "vw", 0)
        starter.close()


CHIEF = """
import sys, time
from hetpipe_tf.distributed.launch import LocalCluster
cluster = LocalCluster(num_ps=1, worker_cpus=[1], cpu_quotas=[0.5])
cluster.start_tasks([("vw", 0, 0, "tests.distributed.ready_task", [])])
cluster.cpu_group(0).add(cluster.pid("vw", 0))  # a process in the group, as a worker task is
print(cluster.cpu_group(0).path, cluster.pid("vw", 0), flush=True)
time.sleep(600)
"""


@needs_cgroups
def test_a_killed_chiefs_groups_are_removed_by_its_reaper():
    controller = find_cpu_controller()
    chief = subprocess.Popen([sys.executable, "-c", CHIEF], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        path, task = chief.stdout.readline().split()
        assert os.path.isdir(path) and int(task) in cgroups.CpuGroup(controller, path, 0.5, 10_000).pids()
    finally:
        chief.send_signal(signal.SIGKILL)
        chief.wait()
    assert not wait_until_gone([int(task)], 10), "the task outlived its killed chief"
    assert wait_for(lambda: not os.path.exists(path), 10), f"{path} is still there 10 s after the chief's kill"
    assert not group_names(controller, chief.pid)


@needs_cgroups
def test_groups_of_owners_no_longer_alive_are_reaped():
    controller = find_cpu_controller()
    dead = subprocess.Popen(["true"])
    dead.wait()
    groups = CpuGroups(owner=dead.pid)
    group = groups.create("left", 0.2)
    assert os.path.isdir(group.path)
    assert f"hetpipe-{dead.pid}-left" in cgroups.reap_orphans(controller)
    assert not os.path.exists(group.path)


@needs_cgroups
def test_a_process_held_in_a_group_goes_back_where_it_was():
    controller = find_cpu_controller()
    groups = CpuGroups()
    try:
        group = groups.create("held", 0.5)
        before = cgroups.current_group(controller, os.getpid())
        with group.holding(os.getpid()):
            assert group.pids() == (os.getpid(),)
        assert group.pids() == () and cgroups.current_group(controller, os.getpid()) == before
    finally:
        groups.remove_all()
    assert not os.path.exists(group.path)


def test_a_missing_root_is_refused_naming_it(tmp_path):
    with pytest.raises(CgroupError, match=f"no cgroup filesystem at {tmp_path}/none .*does not exist"):
        CpuGroups(root=str(tmp_path / "none"))


def test_a_root_without_the_cpu_controller_is_refused(tmp_path):
    with pytest.raises(CgroupError, match=f"no cpu controller under {tmp_path}: neither .*cpu.cfs_quota_us"):
        CpuGroups(root=str(tmp_path))


def test_a_directory_that_is_no_cgroup_hierarchy_is_refused(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    with pytest.raises(CgroupError, match="is not a cgroup cpu hierarchy: a directory made there has no "
                                          "cpu.cfs_quota_us"):
        CpuGroups(root=str(tmp_path))
    assert sorted(os.listdir(tmp_path / "cpu")) == ["cpu.cfs_quota_us"]


@needs_cgroups
def test_a_user_other_than_root_is_refused_naming_it():
    """Not root: this package's process, its uid set to 65534, cannot make a group in the real hierarchy."""
    find_cpu_controller()
    code = ("import os\nfrom hetpipe_tf.distributed.cgroups import CpuGroups, CgroupError\nos.setuid(65534)\n"
            "try:\n    CpuGroups()\nexcept CgroupError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "cannot make a cgroup in" in out.stdout and "uid 65534, not root: making cgroups needs root" in out.stdout, \
        out.stdout + out.stderr


@needs_cgroups
def test_quotas_below_the_kernels_least_or_over_the_machine_are_refused():
    find_cpu_controller()
    groups = CpuGroups()
    with pytest.raises(CgroupError, match="quota of 0.05 cores for 'tiny' is below the kernel's least quota "
                                          r"\(1000 us per period of 10000 us, 0.1 cores\)"):
        groups.create("tiny", 0.05)
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(CgroupError, match=f"total {cores} cores, and this machine gives this process {cores}"):
        LocalCluster(num_ps=1, worker_cpus=[1], cpu_quotas=[cores])
    with pytest.raises(ValueError, match="cpu_quotas gives 2 quotas for 1 worker tasks"):
        LocalCluster(num_ps=1, worker_cpus=[1], cpu_quotas=[0.2, 0.2])


def test_quota_nodes_are_refused_in_process():
    from hetpipe_tf.distributed.cluster_devices import ClusterDevices
    from hetpipe_tf.planning.cluster import load_cluster

    with pytest.raises(ValueError, match=r"CPU-quota device types \['G', 'Q', 'R', 'V'\], which run at their quota "
                                         r"only in their node's processes; .*use launch='processes'"):
        ClusterDevices(load_cluster("paper_quota"), "in_process")


@pytest.mark.slow
@needs_cgroups
def test_a_started_clusters_worker_task_runs_in_its_nodes_group_and_its_ps_task_outside():
    """LocalCluster.start(): the TensorFlow server of a quota node's worker task starts in its group
    (the groups' making and removal test_a_virtual_workers_process_runs_outside_every_quota_group_and_the_group_goes_at_the_end
    covers without TensorFlow), the ps tasks and a node without a quota outside; stop() removes the group."""
    controller = find_cpu_controller()
    cluster = LocalCluster(num_ps=2, worker_cpus=[1, 1], cpu_quotas=[0.5, None])
    try:
        cluster.start()
        group = cluster.cpu_group(0)
        assert group.pids() == (cluster.pid("worker", 0),)
        assert _quota_and_period(group) == (5000, 10_000)
        outside = [cgroups.current_group(controller, cluster.pid(job, i)) for job, i in
                   (("ps", 0), ("ps", 1), ("worker", 1))]
        assert group.path not in outside
    finally:
        cluster.stop()
    assert not os.path.exists(group.path)


def _fake_groups(tmp_path, n):
    """Groups whose procs files are plain files: what a rank's command writes, without cgroups."""
    controller = cgroups.CpuController(str(tmp_path), 1)
    out = []
    for i in range(n):
        (tmp_path / f"g{i}").mkdir()
        (tmp_path / f"g{i}" / "cgroup.procs").write_text("")
        out.append(cgroups.CpuGroup(controller, str(tmp_path / f"g{i}"), 0.1, cgroups.PERIOD_US))
    return out


PID = [sys.executable, "-c", "import os; print(os.getpid())"]


def test_a_ranks_command_enters_the_group_of_its_rank_before_it_runs(tmp_path):
    """One command for every rank (horovodrun's): the shell writes its pid, which the exec'd
    command keeps, into the group of the rank its environment names."""
    groups = _fake_groups(tmp_path, 3)
    command = cgroups.rank_command(groups, PID, "HOROVOD_RANK")
    out = subprocess.run(command, env=dict(os.environ, HOROVOD_RANK="1"), capture_output=True, text=True, check=True)
    assert (tmp_path / "g1" / "cgroup.procs").read_text().split() == [out.stdout.strip()]
    assert (tmp_path / "g0" / "cgroup.procs").read_text() == (tmp_path / "g2" / "cgroup.procs").read_text() == ""
    lost = subprocess.run(command, env=dict(os.environ, HOROVOD_RANK="3"), capture_output=True, text=True)
    assert lost.returncode == 2 and lost.stdout == ""
    assert "no CPU-quota group for $HOROVOD_RANK=3 (ranks 0 to 2 have one)" in lost.stderr
    with pytest.raises(CgroupError, match="is not an environment variable's name"):
        cgroups.rank_command(groups, PID, "RANK; rm")
    with pytest.raises(CgroupError, match="no groups given"):
        cgroups.rank_command([], PID, "HOROVOD_RANK")


@needs_cgroups
def test_a_ranks_command_runs_in_its_real_group():
    controller = find_cpu_controller()
    groups = CpuGroups()
    try:
        made = [groups.create("rank0", 0.2), groups.create("rank1", 0.3)]
        where = [sys.executable, "-c", "import os; print(open(f'/proc/{os.getpid()}/cgroup').read())"]
        out = subprocess.run(cgroups.rank_command(made, where, "HOROVOD_RANK"), capture_output=True, text=True,
                             env=dict(os.environ, HOROVOD_RANK="1"), check=True)
        names = {1: lambda n: "cpu" in n.split(","), 2: lambda n: n == ""}[controller.version]
        line = next(ln for ln in out.stdout.splitlines() if ln and names(ln.split(":")[1]))
        assert os.path.join(controller.path, line.split(":", 2)[2].lstrip("/")) == made[1].path
    finally:
        groups.remove_all()
    assert not os.path.exists(made[1].path)
