#!/usr/bin/env bash
# Host B: the parameter-server and worker tasks of cluster.json's second node. Start it before
# host_a.sh; stop it (Ctrl-C) once host A's training has ended.
#
#   HOST_A=10.0.0.1 HOST_B=10.0.0.2 HETPIPE_AUTHKEY=<key> bash examples/two_machines/host_b.sh
set -euo pipefail
source "$(dirname "$0")/spec.sh"
trap 'kill $(jobs -p) 2>/dev/null' EXIT
python -m hetpipe_tf.distributed.server --cluster_spec="$SPEC" --job_name=ps --task_index=1 &
python -m hetpipe_tf.distributed.server --cluster_spec="$SPEC" --job_name=worker --task_index=1 --logical_cpus=2 &
wait
