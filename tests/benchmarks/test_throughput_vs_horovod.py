"""benchmarks/throughput_vs_horovod.py's own logic, without training: the ceiling, the ratios and
the summary against issue 13's target; on CPU-quota nodes (benchmarks/quota_nodes.py) the bounds
from measured speeds, the summary against its targets and the baselines' flags, and (slow, where
cgroups can be written) a baseline of real compute whose ranks run in groups of their own."""
import os

import pytest

from benchmarks import comparison
from benchmarks import quota_nodes
from benchmarks import throughput_vs_horovod as fig4
from tests.helpers.quota import needs_cgroups


def row(system, images, faithful=True):
    return {"system": system, "images_per_s": images, "overrun_fraction": 0.01, "emulation_faithful": faithful}


def test_the_ceiling_on_issue_13s_cluster_is_1_8():
    assert fig4.ceiling(comparison.device_types("VRQG")) == pytest.approx(1.8, abs=1e-3)
    assert fig4.ceiling(comparison.device_types("V")) == 1.0


def test_np_runs_first_it_calibrates_the_dilation_and_measures_the_profile():
    assert [p[0] for p in fig4.POLICIES] == ["NP", "HD", "ED", "ED-local"]
    assert fig4.POLICIES[0][1] == "np"


def test_ratios_and_summary():
    rows = [row("HetPipe NP", 500.0), row("HetPipe ED", 720.0, faithful=False), row("Horovod", 400.0),
            row("MWMS", 360.0)]
    ratios = {r["system"]: r for r in fig4.ratios(rows)}
    assert ratios["HetPipe NP"]["hetpipe_over_horovod"] == 1.25
    assert ratios["HetPipe ED"]["hetpipe_over_mwms"] == 2.0
    s = fig4.summary(rows, comparison.device_types("VRQG"))
    assert s["best_policy"] == "HetPipe ED" and s["best_over_horovod"] == 1.8
    assert s["target_met"] and s["short_of_target_by"] == 0.0
    assert not s["all_faithful"] and s["emulated"]
    rows[1]["images_per_s"] = 520.0
    s = fig4.summary(rows, comparison.device_types("VRQG"))
    assert not s["target_met"] and s["short_of_target_by"] == 0.2


def test_without_horovod_there_is_no_ratio_and_no_target_met():
    rows = [row("HetPipe NP", 500.0), {"system": "Horovod", "skipped": "the Horovod venv is not built"}]
    assert fig4.ratios(rows)[0]["hetpipe_over_horovod"] is None
    s = fig4.summary(rows, comparison.device_types("VRQG"))
    assert s["best_policy"] is None and not s["target_met"]


def test_a_row_run_in_one_process_stands_beside_and_does_not_count():
    rows = [row("HetPipe NP", 420.0), dict(row("HetPipe ED-local in one process (beside)", 900.0), launch="in_process"),
            row("Horovod", 400.0)]
    assert len(fig4.ratios(rows)) == 2  # its ratio is printed beside
    s = fig4.summary(rows, comparison.device_types("VRQG"))
    assert s["best_policy"] == "HetPipe NP" and s["best_over_horovod"] == 1.05 and not s["target_met"]


def test_each_policy_s_figure_is_its_fastest_nm_and_the_planner_s_choice_is_kept():
    """§8.2: Nm is set per policy so that throughput is highest; a Nm its memory does not admit
    gives a row that says so and counts for nothing."""
    rows = [dict(row("HetPipe HD (planner's Nm)", 480.0), policy_name="HD", planner_nm=True, num_in_flight=2),
            dict(row("HetPipe HD, Nm=4", 560.0), policy_name="HD", num_in_flight=4),
            dict(row("HetPipe HD, Nm=8", 660.0), policy_name="HD", num_in_flight=8),
            dict(row("HetPipe NP (planner's Nm)", 420.0), policy_name="NP", planner_nm=True, num_in_flight=1),
            {"system": "HetPipe NP, Nm=8", "policy_name": "NP", "num_in_flight": 8, "does_not_fit": "Nm <= 4"},
            row("Horovod", 440.0)]
    s = fig4.summary(rows, comparison.device_types("VRQG"))
    assert s["best_policy"] == "HetPipe HD, Nm=8" and s["best_over_horovod"] == 1.5 and s["target_met"]
    assert s["best_by_policy"]["HD"] == {"num_in_flight": 8, "images_per_s": 660.0, "system": "HetPipe HD, Nm=8",
                                         "planner_num_in_flight": 2, "hetpipe_over_horovod": 1.5}
    assert s["best_by_policy"]["NP"]["num_in_flight"] == 1 and s["all_faithful"]


def test_nm_candidates_are_whole_numbers_or_none():
    assert fig4.nm_candidates("4,8") == (4, 8) and fig4.nm_candidates("") == ()
    for bad in ("0", "four", "4,-8"):
        with pytest.raises(ValueError, match="whole numbers >= 1"):
            fig4.nm_candidates(bad)


# --cluster=paper_quota: real compute on CPU-quota nodes (benchmarks/quota_nodes.py)
def _speeds(**speed):
    return {"node_speeds": {t: {"speed": v, "share": 0.3} for t, v in speed.items()}, "all_within_tolerance": True}


def test_the_bound_on_measured_speeds_waits_for_the_slowest_stage():
    """D = 0: every worker at the slowest stage's pace; an all-reduce rank is one stage of the whole model."""
    assert quota_nodes.bound([[0.010, 0.020], [0.040]]) == pytest.approx(2 * 32 / 0.040)
    types = quota_nodes.rank_types(quota_nodes.cluster())
    assert types == ["V", "V", "R", "R", "G", "G", "Q", "Q"]
    speeds = {"V": 0.3, "R": 0.2, "G": 0.12, "Q": 0.1}
    # 8 ranks, each a 10 ms pass on this host, the slowest at 0.1 of it: 8 x 32 / 0.1 s
    assert quota_nodes.allreduce_bound(0.010, speeds, types) == pytest.approx(2560.0)
    assert quota_nodes.allreduce_bound(0.010, speeds, ["V", "V", "R"]) == pytest.approx(3 * 32 * 0.2 / 0.010)
    assert quota_nodes.ceiling(_speeds(**speeds)) == pytest.approx(1.44 / 0.8)


def test_each_node_speed_is_judged_against_its_quota_share():
    row = quota_nodes.speed_row({"V": {"speed": 0.27, "share": 0.3}, "Q": {"speed": 0.08, "share": 0.1}})
    assert row["node_speeds"]["V"]["within_tolerance"] and row["node_speeds"]["V"]["speed_over_share"] == 0.9
    assert not row["node_speeds"]["Q"]["within_tolerance"] and not row["all_within_tolerance"]


def test_the_quota_summary_against_the_targets():
    rows = [{"system": "HetPipe NP (planner's Nm)", "images_per_s": 1800.0, "share_of_bound": 0.7},
            {"system": "HetPipe ED (planner's Nm)", "images_per_s": 3000.0, "share_of_bound": 0.9},
            {"system": "Horovod", "images_per_s": 2000.0, "share_of_bound": 0.8}, {"system": "MWMS", "skipped": "x"}]
    s = quota_nodes.summary(rows, _speeds(V=0.3, R=0.2, G=0.12, Q=0.1))
    assert s["best_policy"] == "HetPipe ED (planner's Nm)" and s["best_over_horovod"] == 1.5
    assert s["best_share_met"] and s["best_over_horovod_met"] and not s["horovod_share_met"]
    assert s["short"] == {"best_share": 0.0, "best_over_horovod": 0.0, "horovod_share": 0.05}
    assert s["emulated"] is False and s["label"] == "real compute, CPU-quota nodes"
    s = quota_nodes.summary(rows[:2], _speeds(V=0.3, R=0.2, G=0.12, Q=0.1))
    assert s["best_over_horovod"] is None and not s["best_over_horovod_met"] and not s["horovod_share_met"]


def test_the_baselines_run_real_compute_with_each_ranks_memory_its_devices():
    argv = quota_nodes.baseline_argv(quota_nodes.rank_types(quota_nodes.cluster()), 4, model="gpt")
    assert "--real_compute" in argv and "--memory=1536M,1536M,3G,3G,768M,768M,1G,1G" in argv
    assert "--steps_per_epoch=5" in argv and not any(a.startswith(("--speeds", "--dilation")) for a in argv)


def test_quota_results_get_their_own_names_and_the_flags_are_checked():
    path = "benchmarks/results/throughput_vs_horovod.jsonl"
    assert fig4.result_path(path, "cnn", True) == "benchmarks/results/throughput_vs_horovod_quota.jsonl"
    assert fig4.result_path(path, "gpt", True) == "benchmarks/results/throughput_vs_horovod_gpt_quota.jsonl"
    assert fig4.result_path(path, "gpt", False) == "benchmarks/results/throughput_vs_horovod_gpt.jsonl"
    assert fig4.result_path("/tmp/mine.jsonl", "gpt", True) == "/tmp/mine.jsonl"
    assert fig4.baselines("Horovod") == ("Horovod",) and fig4.baselines("") == ()
    with pytest.raises(ValueError, match=r"\['horovod'\] unknown; give some of Horovod, MWMS"):
        fig4.baselines("horovod")
    assert [p[0] for p in fig4.quota_policies("ED,NP")] == ["NP", "ED"]
    with pytest.raises(ValueError, match=r"\['XX'\] unknown; give some of NP, HD, ED"):
        fig4.quota_policies("NP,XX")


@pytest.mark.slow
@needs_cgroups
def test_a_real_compute_baseline_runs_each_rank_in_its_group_at_its_speed():
    """MWMS with --real_compute, worker 0 in a group of 0.6 cores and worker 1 of 0.15: nothing
    paced, the line says so, and the slow rank's compute step takes longer by about the quotas'
    ratio (each rank's step is timed on the rank). The groups go at the end."""
    from benchmarks.baselines import mwms
    from hetpipe_tf.distributed.cgroups import CpuGroups

    groups = CpuGroups()
    try:
        made = [groups.create("fast", 0.6), groups.create("slow", 0.15)]
        line = mwms.run(["--workers=2", "--real_compute", "--epochs=2", "--steps_per_epoch=6", "--deadline_s=600"],
                        wrap=lambda rank, cmd: made[rank].command(cmd))
    finally:
        groups.remove_all()
    assert line["emulated"] is False and line["speeds"] is None and "overrun_fraction" not in line
    fast, slow = line["compute_ms_per_step"]
    assert slow / fast > 2.0, line["compute_ms_per_step"]
    assert not any(os.path.exists(g.path) for g in made)


def _train_horovod():
    from benchmarks.baselines.ranks import load_source

    return load_source("train_horovod", "benchmarks/horovod/train_horovod.py")


def test_a_horovod_ranks_kernel_threads_go_to_its_groups_tasks_file(tmp_path):
    """On quota nodes a rank puts the threads TensorFlow's context made (found as those that
    appeared) in its group, one thread id per write to the group's ``tasks`` file, not the thread
    that was there before (its Python): a plain file stands in for the group's. No thread found is
    an error naming the group."""
    import threading

    train_horovod = _train_horovod()
    (tmp_path / "tasks").write_text("")
    before, stop = train_horovod.threads(), threading.Event()
    pool = threading.Thread(target=stop.wait)
    pool.start()
    try:
        train_horovod.kernel_threads_into(str(tmp_path), train_horovod.threads() - before)
    finally:
        stop.set()
        pool.join()
    written = (tmp_path / "tasks").read_text()
    assert str(pool.native_id) in written and not written.startswith(str(threading.main_thread().native_id))
    with pytest.raises(ValueError, match=f"no kernel thread can be put in {tmp_path}"):
        train_horovod.kernel_threads_into(str(tmp_path), set())
