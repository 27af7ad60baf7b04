# The TensorFlow cluster of the two hosts, in the order of cluster.json's nodes: on each host a
# parameter-server task (port BASE) and a worker task (BASE + 1); the chief on host A (BASE + 2).
# Sourced by host_a.sh and host_b.sh; HOST_A and HOST_B are the hosts' addresses.
: "${HOST_A:?set HOST_A to host A's address}" "${HOST_B:?set HOST_B to host B's address}"
: "${HETPIPE_AUTHKEY:?set HETPIPE_AUTHKEY to the same key on both hosts: python -c 'import os; print(os.urandom(16).hex())'}"
export HETPIPE_AUTHKEY
BASE_A=${BASE_PORT_A:-2222}
BASE_B=${BASE_PORT_B:-2222}
SPEC="{\"ps\": [\"$HOST_A:$BASE_A\", \"$HOST_B:$BASE_B\"], \"worker\": [\"$HOST_A:$((BASE_A + 1))\", \"$HOST_B:$((BASE_B + 1))\"], \"chief\": [\"$HOST_A:$((BASE_A + 2))\"]}"
