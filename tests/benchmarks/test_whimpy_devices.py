"""benchmarks/whimpy_devices.py's own logic, without training: Table 4's rows."""
from benchmarks import whimpy_devices as table4


def hetpipe(images, nm, workers=1):
    return {"images_per_s": images, "num_in_flight": nm, "concurrent_minibatches": nm * workers,
            "virtual_workers": [["V"]] * workers, "emulation_faithful": True}


def horovod(images, ranks, left_out=()):
    return {"images_per_s": images, "ranks": ranks, "left_out": list(left_out), "emulation_faithful": True}


def test_table_rows_carry_ratios_gains_and_left_out_devices():
    rows = table4.table({"V": hetpipe(200.0, 1), "VR": hetpipe(330.0, 3), "VRQG": hetpipe(480.0, 5)},
                        {"V": horovod(200.0, 1), "VR": horovod(250.0, 2),
                         "VRQG": horovod(300.0, 3, ["rank 3 left out: ..."])})
    assert [r["types"] for r in rows] == ["V", "VR", "VRQG"]  # VRQ was not run
    v, vr, vrqg = rows
    assert v["hetpipe_over_horovod"] == 1.0 and v["hetpipe_gain_over_V"] == 1.0
    assert vr["hetpipe_over_horovod"] == 1.32 and vr["horovod_gain_over_V"] == 1.25
    assert vrqg["concurrent_minibatches"] == 5 and vrqg["devices"] == 4
    assert vrqg["horovod_ranks"] == 3 and vrqg["horovod_left_out"] == ["rank 3 left out: ..."]
    assert vrqg["hetpipe_gain_over_V"] == 2.4 and vrqg["all_faithful"] and vrqg["emulated"]


def test_a_row_without_horovod_has_no_ratio():
    (row,) = table4.table({"V": hetpipe(200.0, 1)}, {"V": {"system": "Horovod", "skipped": "not built"}})
    assert row["hetpipe_over_horovod"] is None and row["horovod_images_per_s"] is None
    assert not row["all_faithful"]
