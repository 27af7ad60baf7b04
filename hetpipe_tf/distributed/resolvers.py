"""TensorFlow's cluster resolvers as the cluster of a hetpipe_tf run.

``HetPipeStrategy(cluster=DESCRIPTION, cluster_resolver=RESOLVER)`` takes the tasks of a
``tf.distribute.cluster_resolver`` (``TFConfigClusterResolver``, ``SlurmClusterResolver``,
``KubernetesClusterResolver``) instead of a ``TF_CONFIG`` written by hand, and runs as
``launch="tf_config"`` does (:class:`hetpipe_tf.distributed.launch.TFConfigCluster`). The rule
that maps the resolver's tasks to the description's nodes:

* the resolver's cluster has the jobs ``chief`` (one task), ``ps`` and ``worker`` (one task per
  node of the description each) and no other;
* ``worker`` task i is node i, in the description's node order: it holds node i's devices
  (its logical CPUs, or its GPUs) and starts the processes of the virtual workers whose home
  is node i; ``ps`` task i is node i's parameter server (HetPipe §8.1: one per node);
* the chief is this process: a resolver that names this process's task (TF_CONFIG's
  ``task``, Slurm's rank) must name the chief; one that names none (Kubernetes') makes it so.

Where each task runs is the resolver's: Slurm's gives the jobs chief, ps and worker consecutive
Slurm tasks over the hosts in sorted order (so worker task i is on the i-th host only if the
tasks are laid out for it: ``examples/slurm/hetpipe_two_nodes.sbatch``), Kubernetes' the host
IP of each pod its label selectors find, TF_CONFIG's what it says. Every task of the resolver's
cluster may run ``python -m hetpipe_tf.distributed.resolvers`` (:func:`main`): a ps or worker
task becomes its server (:mod:`hetpipe_tf.distributed.server`), the chief runs the command
given, with ``TF_CONFIG`` naming it the chief (e.g. ``hetpipe-train --launch=tf_config``), so
that one command line serves every task of a Slurm step or a TFJob.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.planning.cluster import Cluster, load_cluster

if TYPE_CHECKING:
    from hetpipe_tf.compat import ClusterResolver

#: The resolvers :func:`make_resolver` makes by name.
RESOLVERS = ("tf_config", "slurm")
#: The jobs of a hetpipe_tf cluster.
JOBS = ("chief", "ps", "worker")


class ResolverError(HetPipeUsageError, ValueError):
    """A cluster resolver's tasks do not fit the cluster description, or it cannot be made here."""


@dataclasses.dataclass(frozen=True)
class ResolvedCluster:
    """The tasks of a resolver's cluster, mapped to a description's nodes, and this process's task.

    Attributes:
      spec: {job: [host:port, ...]} of the jobs ``chief``, ``ps`` and ``worker``; ``ps`` and
        ``worker`` task i are node i.
      task_type: this process's job.
      task_id: this process's index in its job.
      node_names: the description's node names, in its order (node i).
    """

    spec: Mapping[str, tuple[str, ...]]
    task_type: str
    task_id: int
    node_names: tuple[str, ...]

    def tf_config(self) -> str:
        """TF_CONFIG naming this process's task in the resolved cluster."""
        return json.dumps({"cluster": {job: list(tasks) for job, tasks in self.spec.items()},
                           "task": {"type": self.task_type, "index": self.task_id}})

    def describe(self) -> str:
        """Which tasks each node has, one line per node, and the chief."""
        lines = [f"node {i} ({name}): worker task {self.spec['worker'][i]}, ps task {self.spec['ps'][i]}"
                 for i, name in enumerate(self.node_names)]
        return "\n".join(lines + [f"chief: {self.spec['chief'][0]}"])


def _spec_of(resolver: ClusterResolver) -> dict[str, list[str]]:
    """The resolver's cluster as {job: [address, ...]}: a job given sparsely ({index: address})
    must number its tasks 0..n-1.

    Returns:
        The cluster spec.

    Raises:
        ResolverError: a sparse job does not number its tasks 0..n-1.
    """
    spec = {}
    for job, tasks in resolver.cluster_spec().as_dict().items():
        if isinstance(tasks, dict):
            if sorted(tasks) != list(range(len(tasks))):
                raise ResolverError(f"the resolver's job {job!r} has tasks {sorted(tasks)}; hetpipe_tf needs them "
                                    f"numbered 0..{len(tasks) - 1}")
            tasks = [tasks[i] for i in range(len(tasks))]
        spec[job] = list(tasks)
    return spec


def resolve(resolver: ClusterResolver, description: Cluster) -> ResolvedCluster:
    """Maps `resolver`'s tasks to `description`'s nodes by the rule of the module docstring;
    ResolverError naming what the resolver gave and what the description needs.

    Args:
        resolver: a TensorFlow ClusterResolver.
        description: the cluster description whose nodes its tasks serve.

    Returns:
        The ResolvedCluster: the TensorFlow cluster spec and this process's task.

    Raises:
        ResolverError: the resolver's tasks do not map onto the description's nodes (one chief, a
            ps and a worker task per node), or its jobs are numbered sparsely.
    """
    spec = _spec_of(resolver)
    nodes = tuple(n.name for n in description.nodes)
    want = {"chief": 1, "ps": len(nodes), "worker": len(nodes)}
    got = {job: len(tasks) for job, tasks in spec.items()}
    if got != want:
        raise ResolverError(f"{type(resolver).__name__} resolves the tasks {got}; cluster '{description.name}' "
                            f"({len(nodes)} nodes) needs {want}: one chief, and one ps and one worker task per node "
                            f"(task i is node i); give the resolver these jobs (e.g. SlurmClusterResolver(jobs="
                            f"{want}), or TF_CONFIG's cluster)")
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type is None:  # a resolver that does not know this process's task (Kubernetes'): the chief
        task_type, task_id = "chief", 0
    if task_type not in JOBS or not 0 <= int(task_id or 0) < want[task_type]:
        raise ResolverError(f"{type(resolver).__name__} names this process task {task_type}:{task_id}, which is "
                            f"not in the cluster {want}")
    return ResolvedCluster({job: tuple(spec[job]) for job in JOBS}, str(task_type), int(task_id or 0), nodes)


def chief_environ(resolver: ClusterResolver, description: Cluster,
                  environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (default: this process's) with the TF_CONFIG of the chief of `resolver`'s cluster,
    for :class:`hetpipe_tf.distributed.launch.TFConfigCluster`; ResolverError if the resolver names
    this process another task.

    Returns:
        The environment.

    Raises:
        ResolverError: the resolver's tasks do not fit the description, or it names this process
            another task.
    """
    resolved = resolve(resolver, description)
    if resolved.task_type != "chief":
        raise ResolverError(f"{type(resolver).__name__} names this process task {resolved.task_type}:"
                            f"{resolved.task_id}; HetPipeStrategy runs in the chief. Run every task through "
                            f"`python -m hetpipe_tf.distributed.resolvers` (a ps or worker task becomes its server, "
                            f"the chief runs your program)")
    return dict(os.environ if environ is None else environ, TF_CONFIG=resolved.tf_config())


def launch_for(launch: str, resolver: ClusterResolver | None) -> str:
    """The launch of a strategy given `resolver` (None: `launch` as asked): a resolver's tasks run
    where it says, started elsewhere, as under "tf_config"; "in_process" has no tasks to resolve.

    Returns:
        The launch.

    Raises:
        ResolverError: a resolver is given with launch "in_process".
    """
    if resolver is None:
        return launch
    if launch == "in_process":
        raise ResolverError("cluster_resolver= gives the tasks of a cluster; launch='in_process' runs none: drop "
                            "launch (a resolver's cluster runs as launch='tf_config') or the resolver")
    return "tf_config"


def _slurm_tasks_per_node(environ: Mapping[str, str]) -> int:
    from hetpipe_tf.compat import expand_tasks_per_node  # late: defers TensorFlow

    text = environ.get("SLURM_STEP_TASKS_PER_NODE")
    if not text:
        raise ResolverError("resolver 'slurm' reads SLURM_STEP_TASKS_PER_NODE, which is not set: run under "
                            "`srun` (one Slurm task per hetpipe_tf task)")
    return int(max(expand_tasks_per_node(text)))


def make_resolver(name: str, description: Cluster, port_base: int = 8888,
                  environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """TensorFlow's resolver `name` for `description`'s cluster, as every task of a job step or
    TFJob makes it: "tf_config", ``TFConfigClusterResolver`` (a TFJob sets TF_CONFIG in each
    pod); "slurm", ``SlurmClusterResolver`` with the jobs of the rule (a chief, then one ps and
    one worker task per node) over the step's tasks, ports from `port_base`, and its GPU split
    turned off (a node's worker task sees its node's GPUs, not an even share of Slurm's).
    ``KubernetesClusterResolver`` needs its pods' labels and is made by the caller.

    Returns:
        The resolver.

    Raises:
        ResolverError: `name` is unknown, or "slurm" runs outside a Slurm step.
    """
    import tensorflow as tf  # late: defers TensorFlow

    environ = os.environ if environ is None else environ
    if name == "tf_config":
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if name == "slurm":
        jobs = {"chief": 1, "ps": len(description.nodes), "worker": len(description.nodes)}
        # The resolver gives task k of a host GPUs k*per_task.. of it and needs them to exist; hetpipe_tf
        # places GPUs itself, so one nominal GPU per task, never set in CUDA_VISIBLE_DEVICES.
        return tf.distribute.cluster_resolver.SlurmClusterResolver(jobs=jobs, port_base=port_base,
                                                     gpus_per_node=_slurm_tasks_per_node(environ), gpus_per_task=1,
                                                     auto_set_gpu=False)
    raise ResolverError(f"unknown resolver {name!r}; allowed: {', '.join(RESOLVERS)}")


def task_command(resolved: ResolvedCluster, description: Cluster,
                 chief_command: list[str]) -> tuple[list[str], dict[str, str]]:
    """What this task runs and the environment it adds: a ps task its server on its CPU, with no GPU
    visible (its weights live on its CPU, :func:`hetpipe_tf.distributed.launch.ps_device`); a worker
    task its server, with a logical CPU per emulated or host-CPU device of its node (GPUs are found
    as they are); the chief `chief_command`. Every one gets TF_CONFIG naming its task.

    Returns:
        The command and the environment it adds.

    Raises:
        ResolverError: this process is the chief and no `chief_command` is given.
    """
    env = {"TF_CONFIG": resolved.tf_config()}
    if resolved.task_type == "chief":
        if not chief_command:
            raise ResolverError("this process is the chief: give the chief's command after --, e.g. "
                                "-- hetpipe-train --cluster=FILE --launch=tf_config")
        return list(chief_command), env
    node = description.nodes[resolved.task_id]
    cpus = node.count if resolved.task_type == "worker" and description.device_types[node.device_type].on_host else 1
    if resolved.task_type == "ps":
        env["CUDA_VISIBLE_DEVICES"] = ""
    spec = {job: list(tasks) for job, tasks in resolved.spec.items()}
    return [sys.executable, "-m", "hetpipe_tf.distributed.server", f"--cluster_spec={json.dumps(spec)}",
            f"--job_name={resolved.task_type}", f"--task_index={resolved.task_id}",
            f"--logical_cpus={cpus}"], env


def main(argv: list[str] | None = None) -> None:
    """``python -m hetpipe_tf.distributed.resolvers --resolver=NAME --cluster=FILE -- CHIEF COMMAND``:
    resolves this task and replaces this process with its server (ps, worker) or the chief's command,
    with TF_CONFIG set."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m hetpipe_tf.distributed.resolvers",
                                     description="Runs this task of a resolver's cluster: its server, or the chief.")
    parser.add_argument("--resolver", required=True, choices=RESOLVERS)
    parser.add_argument("--cluster", required=True, help="the cluster description (a name or a JSON file)")
    parser.add_argument("--port_base", type=int, default=8888, help="slurm: the first port of a host's tasks")
    args = parser.parse_args(argv[:split])
    description = load_cluster(args.cluster)
    resolved = resolve(make_resolver(args.resolver, description, args.port_base), description)
    print(f"hetpipe resolvers: this process is {resolved.task_type}:{resolved.task_id}\n{resolved.describe()}",
          flush=True)
    command, env = task_command(resolved, description, argv[split + 1:])
    os.execvpe(command[0], command, dict(os.environ, **env))


if __name__ == "__main__":
    main()
