"""A workstation of two kinds of GPU through the seam of hetpipe_tf.distributed.gpus: its fake
listing (for HETPIPE_FAKE_GPUS, which a process and its children read) and its cluster description."""
#: A workstation of two kinds of GPU: two TITAN V and two RTX 2060, the 2060s first (as CUDA may list them).
LISTING = [{"index": 0, "name": "NVIDIA GeForce RTX 2060", "memory": "5.5G", "compute_capability": [7, 5]},
           {"index": 1, "name": "NVIDIA GeForce RTX 2060", "memory": "5.5G", "compute_capability": [7, 5]},
           {"index": 2, "name": "NVIDIA TITAN V", "memory": "11.5G", "compute_capability": [7, 0]},
           {"index": 3, "name": "NVIDIA TITAN V", "memory": "11.5G", "compute_capability": [7, 0]}]


def mixed(v_gpus=(2, 3), g_gpus=None, **g_node):
    """The two-type cluster of the listing: node-V on `v_gpus`, node-G on `g_gpus` (None: not named)."""
    nodes = [{"name": "node-V", "device_type": "V", "count": 2, "gpus": list(v_gpus)},
             dict({"name": "node-G", "device_type": "G", "count": 2}, **g_node)]
    if g_gpus is not None:
        nodes[1]["gpus"] = list(g_gpus)
    return {"name": "workstation",
            "device_types": {"V": {"label": "TITAN V", "peak_tflops": 14.9, "memory": "8G",
                                   "memory_bandwidth_GBps": 653},
                             "G": {"label": "RTX 2060", "peak_tflops": 6.45, "memory": "6G",
                                   "memory_bandwidth_GBps": 336}},
            "nodes": nodes, "links": {"intra_node_GBps": 15.75, "inter_node_GBps": 15.75}}
