import json

import pytest

from hetpipe_tf.planning.cluster import ClusterError, PRESETS, load_cluster


def test_paper_preset_is_table_1():
    c = load_cluster("paper")
    assert [(n.device_type, n.count) for n in c.nodes] == [("V", 4), ("R", 4), ("G", 4), ("Q", 4)]
    t = c.device_types
    assert [t[k].memory // 2 ** 30 for k in "VRGQ"] == [12, 24, 6, 8]
    assert [round(t[k].peak_tflops, 1) for k in "VRGQ"] == [14.9, 16.3, 6.5, 5.3]
    assert c.intra_node_bandwidth == 15.75e9 and c.inter_node_bandwidth == 7e9
    devices = c.devices()
    assert len(devices) == 16 and devices[5].name == "node-R:1"
    assert c.bandwidth(devices[0], devices[1]) == 15.75e9 and c.bandwidth(devices[0], devices[4]) == 7e9


def test_local_preset_is_emulated():
    c = load_cluster("local")
    assert c.emulated and {d.type.emulated_speed for d in c.devices()} == {1.0, 0.5}


def test_local_cpu_preset_is_the_host_cpu_as_it_is():
    c = load_cluster("local_cpu")
    assert not c.emulated and c.on_host and len(c.devices()) == 4
    assert all(d.type.host_cpu and d.type.host_speed == 1.0 for d in c.devices())


def test_paper_quota_preset_stands_as_the_emulated_paper_types_and_leaves_a_third_of_a_core():
    c = load_cluster("paper_quota")
    assert [(n.device_type, n.count) for n in c.nodes] == [("V", 2), ("R", 2), ("G", 2), ("Q", 2)]
    quotas = {k: t.cpu_quota for k, t in c.device_types.items()}
    assert quotas == {"V": 0.3, "R": 0.2, "G": 0.12, "Q": 0.1}
    # the speeds of V, R, G, Q in the emulated comparisons: 1, 0.67, 0.4, 0.33
    for k, speed in (("R", 0.67), ("G", 0.4), ("Q", 0.33)):
        assert quotas[k] / quotas["V"] == pytest.approx(speed, abs=0.005)
    assert c.node_quotas() == (0.6, 0.4, 0.24, 0.2)
    assert 2 - sum(c.node_quotas()) >= 1 / 3  # this 2-core machine's rest for the chief and the servers
    assert all(d.type.host_cpu and d.type.on_host and d.type.host_speed == d.type.cpu_quota for d in c.devices())
    assert load_cluster("local_cpu").node_quotas() == (None, None)


def test_json_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(PRESETS["local"]))
    assert load_cluster(str(path)).name == "local"


@pytest.mark.parametrize("change,match", [
    (lambda s: s["nodes"][0].update(device_type="X"), "unknown device type 'X'; known: \\['F', 'S'\\]"),
    (lambda s: s["nodes"][0].update(count=-1), "count must be a positive integer, got -1"),
    (lambda s: s["device_types"]["F"].update(memory="0M"), "memory size must be > 0"),
    (lambda s: s["device_types"]["F"].pop("emulated_speed"), "give peak_tflops and memory_bandwidth_GBps"),
    (lambda s: s["device_types"]["F"].update(host_cpu=True), "got emulated_speed and host_cpu"),
    (lambda s: s["device_types"]["F"].update(host_cpu="yes"), "host_cpu is true or false, got 'yes'"),
    (lambda s: s["links"].update(inter_node_GBps=0), "inter_node_GBps must be a bandwidth > 0"),
    (lambda s: s["device_types"]["F"].update(cpu_quota=0.4), "cpu_quota is a share of this host's CPU, for a "
                                                             "\"host_cpu\": true type only"),
    (lambda s: s["device_types"]["F"].update(cpu_quota=0, host_cpu=True, emulated_speed=None),
     "cpu_quota is the cores of each device, a number > 0 \\(e.g. 0.4\\), got 0"),
    (lambda s: s.pop("links"), "missing 'links'"),
    (lambda s: s["links"].update(inter_node_latency_ms=-1), "inter_node_latency_ms must be a number >= 0, got -1"),
    (lambda s: s["links"].update(emulate="yes"), "links.emulate is true or false, got 'yes'"),
    (lambda s: s["nodes"].append(dict(s["nodes"][0])), "node name 'host-F' is used twice"),
])
def test_bad_descriptions_say_what_is_wrong(change, match):
    spec = json.loads(json.dumps(PRESETS["local"]))
    change(spec)
    with pytest.raises(ClusterError, match=match):
        load_cluster(spec)


def test_unknown_name():
    with pytest.raises(ClusterError, match="no cluster preset or file named 'moon'; presets: \\['local', 'local_cpu', 'paper', 'paper_quota'\\]"):
        load_cluster("moon")


def test_with_device_types_keeps_those_nodes():
    from hetpipe_tf.planning.cluster import with_device_types

    vr = with_device_types("paper", "VR")
    assert [n.name for n in vr.nodes] == ["node-V", "node-R"] and set(vr.device_types) == {"V", "R"}
    assert len(vr.devices()) == 8 and vr.inter_node_bandwidth == load_cluster("paper").inter_node_bandwidth
    with pytest.raises(ClusterError, match="no nodes"):
        with_device_types("paper", "X")
