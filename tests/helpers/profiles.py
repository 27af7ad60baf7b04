"""Planner inputs the tests share: made-up profiles and clusters, and the partitioner's search
before its branch and bound (the reference the faster searches must equal)."""
import json

from hetpipe_tf.planning.cluster import PRESETS, load_cluster
from hetpipe_tf.planning.partitioner import InfeasiblePartitionError, distinct_orders, partition_dp
from hetpipe_tf.planning.profile import Profile, SegmentTimes


def toy_profile(n=4):
    return Profile(model="toy", batch_size=8, starts=tuple(range(n)), weight_bytes=(100,) * n,
                   state_bytes=(10,) * n, activation_bytes=(1000,) * n, cut_bytes=(0,) + (500,) * (n - 1),
                   forward_flops=(1,) * n, backward_flops=(2,) * n, traffic_bytes=(1,) * n, kernels=(1,) * n,
                   times={"host": SegmentTimes((1.0,) * n, (2.0,) * n, 0.5, 0.25, "test")},
                   apply_base=0.1, apply_per_byte=0.001)


def model_profile(n=12, activation=150 * 2 ** 20, weights=40 * 2 ** 20):
    """A synthetic convnet-like profile: big early activations, growing weights."""
    return Profile(model="synthetic", batch_size=32, starts=tuple(range(n)),
                   weight_bytes=tuple(weights * (i + 1) // n for i in range(n)), state_bytes=(0,) * n,
                   activation_bytes=tuple(activation * (n - i) // n for i in range(n)),
                   cut_bytes=(0,) + tuple(activation * (n - i) // (4 * n) for i in range(1, n)),
                   forward_flops=(4e10,) * n, backward_flops=(8e10,) * n, traffic_bytes=(2e8,) * n,
                   kernels=(10,) * n, layer_names=tuple(f"layer{i}" for i in range(n)))


def one_by_one(model, devices, nm):
    """The search before the branch and bound: every distinct order cut by the dynamic program,
    the first best kept (ties within 1e-12)."""
    best, errors = None, []
    for order in distinct_orders(devices):
        try:
            part = partition_dp(model, order, nm)
        except InfeasiblePartitionError as e:
            errors.append(e)
            continue
        if best is None or part.bottleneck < best.bottleneck - 1e-12:
            best = part
    if best is None:
        raise errors[0]
    return best


def random_cluster(rng, max_nodes=4, max_count=3):
    spec = json.loads(json.dumps(PRESETS["paper"]))
    types = list(spec["device_types"])
    for t in types:  # memory tight enough that some cuts and some Nm do not fit
        spec["device_types"][t]["memory"] = f"{rng.randint(700, 4000)}M"
    spec["nodes"] = [{"name": f"n{i}", "device_type": rng.choice(types), "count": rng.randint(1, max_count)}
                     for i in range(rng.randint(2, max_nodes))]
    return load_cluster(spec)


def random_profile(rng, n=None):
    n = n or rng.randint(3, 9)
    mib = 2 ** 20
    return Profile(model="random", batch_size=8, starts=tuple(range(n)),
                   weight_bytes=tuple(rng.randint(0, 60) * mib for _ in range(n)),
                   state_bytes=tuple(rng.randint(0, 5) * mib for _ in range(n)),
                   activation_bytes=tuple(rng.randint(1, 120) * mib for _ in range(n)),
                   cut_bytes=(0,) + tuple(rng.randint(1, 40) * mib for _ in range(n - 1)),
                   forward_flops=tuple(rng.uniform(1e10, 2e11) for _ in range(n)),
                   backward_flops=tuple(rng.uniform(2e10, 4e11) for _ in range(n)),
                   traffic_bytes=tuple(rng.uniform(1e7, 1e9) for _ in range(n)), kernels=(4,) * n,
                   layer_names=tuple(f"l{i}" for i in range(n)))
