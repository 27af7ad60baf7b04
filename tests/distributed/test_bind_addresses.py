"""Which addresses a cluster's tasks listen on (issue 12: servers bind loopback unless told otherwise)."""
import os

from hetpipe_tf.distributed.launch import LocalCluster


def _listening(pid):
    """(address, port) of every TCP socket process `pid` listens on; address "*" for every interface."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            if int(address, 16) == 0:
                host = "*"
            elif table == "tcp":
                host = ".".join(str(b) for b in bytes.fromhex(address)[::-1])
            else:
                host = address
            found.add((host, int(port, 16)))
    return found


def test_tasks_listen_on_their_own_address_but_tensorflows_server_on_every_interface(tmp_path):
    with LocalCluster(num_ps=1, worker_cpus=[1], log_dir=str(tmp_path), task_starters=True) as cluster:
        for job, index in cluster.tasks:
            port = int(cluster.address(job, index).rsplit(":", 1)[1])
            listening = _listening(cluster.pid(job, index))
            # hetpipe_tf's own sockets (heartbeats; the worker's task starter) bind the task's address.
            ours = {address for address, p in listening if p != port}
            assert ours == {"127.0.0.1"} and len(listening) == (3 if job == "worker" else 2), (job, listening)
            # TensorFlow's gRPC server listens on every interface whatever the spec names
            # (grpc_server_lib.cc binds "0.0.0.0:PORT"): README says how to keep it off the network.
            assert ("*", port) in listening, (job, listening)
