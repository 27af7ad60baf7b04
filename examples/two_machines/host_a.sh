#!/usr/bin/env bash
# Host A: the parameter-server and worker tasks of cluster.json's first node, then the chief,
# which plans the run on both hosts' devices and trains (TF_CONFIG names it the chief). Extra
# arguments go to hetpipe-train, e.g. --epochs=3.
#
#   HOST_A=10.0.0.1 HOST_B=10.0.0.2 HETPIPE_AUTHKEY=<key> bash examples/two_machines/host_a.sh
set -euo pipefail
source "$(dirname "$0")/spec.sh"
trap 'kill $(jobs -p) 2>/dev/null' EXIT
python -m hetpipe_tf.distributed.server --cluster_spec="$SPEC" --job_name=ps --task_index=0 &
python -m hetpipe_tf.distributed.server --cluster_spec="$SPEC" --job_name=worker --task_index=0 --logical_cpus=2 &
TF_CONFIG="{\"cluster\": $SPEC, \"task\": {\"type\": \"chief\", \"index\": 0}}" \
  hetpipe-train --cluster="$(dirname "$0")/cluster.json" --launch=tf_config --policy=ed --model=cnn "$@"
