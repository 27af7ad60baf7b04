"""The baselines' flags, the leave-out rule and the JSON line (benchmarks/baselines/ranks.py), and
the Horovod script's own argument handling, in the main venv without Horovod."""
import argparse
import importlib.util
import os

import pytest

from benchmarks.baselines import ranks

MiB = 1024 ** 2


def args(*argv):
    return ranks.check(ranks.add_arguments(argparse.ArgumentParser()).parse_args(list(argv)))


def horovod_script():
    path = os.path.join(ranks.ROOT, "benchmarks", "horovod", "train_horovod.py")
    spec = importlib.util.spec_from_file_location("train_horovod", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no Horovod: main() does
    return module


def test_speeds_one_per_rank_or_one_for_all():
    assert ranks.speeds_and_dilation(args("--speeds=1,0.5,0.25"), 3) == ((1.0, 0.5, 0.25), None)
    assert ranks.speeds_and_dilation(args("--speeds=0.5", "--dilation=3"), 2) == ((0.5, 0.5), 3.0)
    with pytest.raises(ranks.BaselineOptionError, match=r"--speeds='1,0.5' gives 2 values for 4 ranks"):
        ranks.speeds_and_dilation(args("--speeds=1,0.5"), 4)
    with pytest.raises(ranks.BaselineOptionError, match=r"--speeds: '-1' is not a number > 0"):
        ranks.speeds_and_dilation(args("--speeds=1,-1"), 2)


def test_slowdowns_give_the_speeds_and_the_dilation():
    speeds, dilation = ranks.speeds_and_dilation(args("--slowdowns=3,4.5,7.5,9"), 4)
    assert dilation == 3 and speeds == pytest.approx((1, 2 / 3, 0.4, 1 / 3))
    with pytest.raises(ranks.BaselineOptionError, match="without --speeds and --dilation"):
        args("--slowdowns=3,9", "--dilation=2")
    with pytest.raises(ranks.BaselineOptionError, match="the smallest is the dilation, which must be >= 1"):
        ranks.speeds_and_dilation(args("--slowdowns=0.5,2"), 2)


def test_flags_that_no_rank_count_fixes():
    with pytest.raises(ranks.BaselineOptionError, match=r"--warmup_epochs=3 must be from 0 to --epochs - 1 = 2"):
        args("--epochs=3", "--warmup_epochs=3")
    with pytest.raises(ranks.BaselineOptionError, match=r"--dilation=0.5 must be >= 1"):
        args("--dilation=0.5")
    with pytest.raises(ranks.BaselineOptionError, match=r"--batch_size=0 must be >= 1"):
        args("--batch_size=0")


def test_memory_sizes():
    assert ranks.memories(args("--memory=8M,512K,1G"), 3) == (8 * MiB, 512 * 1024, 1024 * MiB)
    assert ranks.memories(args(), 2) == (None, None)
    with pytest.raises(ranks.BaselineOptionError, match=r"--memory: '8X' is not a memory size > 0"):
        ranks.memories(args("--memory=8X"), 2)


def test_a_rank_that_cannot_hold_the_model_is_left_out():
    need = ranks.model_need(weight_bytes=1 * MiB, state_bytes=0, activation_bytes=2 * MiB, optimizer_slots=1)
    assert sum(need.values()) == 5 * MiB  # weights, gradients, one slot, activations
    admitted, lines = ranks.admit((8 * MiB, 5 * MiB, 4 * MiB, None), need)
    assert admitted == [0, 1, 3]
    assert lines == ["rank 2 left out: its emulated device holds 4.0 MiB, the whole model needs 5.0 MiB "
                     "(weights 1.0 MiB, gradients 1.0 MiB, optimizer slots 1.0 MiB, activations 2.0 MiB)"]
    with pytest.raises(ranks.BaselineOptionError, match=r"no rank can hold the whole model \(5.0 MiB\)"):
        ranks.admit((4 * MiB,), need)


def test_plan_keeps_the_admitted_ranks_speeds():
    need = ranks.model_need(MiB, 0, MiB, 0)
    plan = ranks.plan(args("--speeds=1,0.5,0.25", "--memory=8M,1M,8M"), 3, need)
    assert (plan.admitted, plan.speeds, plan.dilation) == ((0, 2), (1.0, 0.25), None)
    assert plan.index(2) == 1 and plan.index(1) is None and len(plan.left_out) == 1


def test_record_reports_images_per_second_over_the_measured_epochs():
    a = args("--epochs=3", "--warmup_epochs=1", "--speeds=1,0.5")
    plan = ranks.plan(a, 2, ranks.model_need(MiB, 0, MiB, 0))
    report = ranks.emulation.EmulationReport(4.0, tasks=100, overran=6, calibration=((3.0, 0.1), (4.0, 0.01)))
    line = ranks.record("mwms", a, plan, 0.002, report, [9.0, 2.0, 2.0], [0.5, 0.7, 0.8],
                        images_per_epoch=640, steps_per_epoch=10)
    assert line["images_per_s"] == 320.0  # 2 measured epochs of 640 images in 4 s
    assert line["epoch_wall_s"] == [9.0, 11.0, 13.0]
    assert (line["system"], line["ranks"], line["speeds"], line["reference_ms"]) == ("mwms", 2, [1.0, 0.5], 2.0)
    assert line["emulated"] is True and line["emulation_faithful"] is False and line["overrun_fraction"] == 0.06
    assert "not faithful" in line["warning"]
    assert (line["host_cpu_busy"], line["host_saturated"]) == (None, None)  # not measured
    busy = ranks.record("mwms", a, plan, 0.002, report, [9.0, 2.0, 2.0], [0.5, 0.7, 0.8], images_per_epoch=640,
                        steps_per_epoch=10, host_cpu_busy=0.95)
    assert (busy["host_cpu_busy"], busy["host_saturated"]) == (0.95, True)


def test_horovod_script_flags_and_its_ranks(monkeypatch):
    script = horovod_script()
    a = script.arguments(["--slowdowns=3,4.5,7.5,9", "--memory=8M"])
    assert ranks.speeds_and_dilation(a, 4)[1] == 3
    with pytest.raises(ranks.BaselineOptionError, match="without --speeds and --dilation"):
        script.arguments(["--slowdowns=3,9", "--speeds=1,2"])
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    with pytest.raises(ranks.BaselineOptionError, match="run this script with horovodrun"):
        script.horovod_ranks()
    monkeypatch.setenv("HOROVOD_RANK", "2")
    monkeypatch.setenv("HOROVOD_SIZE", "4")
    assert script.horovod_ranks() == (2, 4)


def test_real_compute_takes_no_emulation_flag_and_its_line_says_so():
    with pytest.raises(ranks.BaselineOptionError, match="--real_compute runs nothing emulated: leave out --speeds, "
                                                        "--reference_ms"):
        args("--real_compute", "--speeds=1,0.5", "--reference_ms=3")
    a = args("--real_compute", "--epochs=2")
    plan = ranks.plan(a, 2, ranks.model_need(MiB, 0, MiB, 0))
    line = ranks.record("horovod", a, plan, None, None, [5.0, 2.0], [0.5, 0.6], images_per_epoch=640,
                        steps_per_epoch=10)
    assert line["emulated"] is False and line["speeds"] is None and line["images_per_s"] == 320.0
    assert not any(k in line for k in ("reference_ms", "dilation", "overrun_fraction", "warning"))
