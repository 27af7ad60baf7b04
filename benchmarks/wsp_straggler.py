"""Stragglers under Wave Synchronous Parallel: throughput, wait and idle time for D = 0, 1, 4, 32 (JSON lines).

Four virtual workers of two EMULATED devices each (speed 1, one dense block per stage)
train under WSP in one process (launch "in_process": the benchmark measures the
synchronisation, not gRPC). Scenarios, each with the same random seed for every D:

* ``transient``: every worker is slowed 2x for a whole wave with probability 0.3, as
  on a shared cluster. A plain wave model of this scenario (worker i may start wave c
  once every worker finished wave c - D - 1) bounds what bounded staleness can gain;
  its D=4 / D=0 ratio is reported beside the measured one (target: >= 1.2).
* ``persistent``: worker 0 is always 2x slower. In the long run no D beats the slow
  worker's pace, so the ratio should stay near 1: the planner's allocation is the remedy.

Per row: images/s over the whole run, its ratio to D=0, the simulator's prediction of
both (the passes at their emulated times, the pushes, merges and pulls at the times the
run's trace measured), the same steady (after the first fifth of the minibatches: the run's
start, whose first calls trace the synchronisation's functions, left out) with the
prediction's ratio to it, every worker's average wait for pulled weights and the part of it
its first stage ran nothing (idle, §8.4), and the emulation's overrun fraction. The last rows
compare wait(D=4)/wait(D=0) and idle/wait with the paper's 62 % and 18 % (§8.4).

    python benchmarks/wsp_straggler.py [--waves=100] [--dilation=20]
"""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WORKERS, STAGES, NM, BATCH = 4, 2, 2, 32
BOUNDS = (0, 1, 4, 32)
STEADY_FROM = 0.2  # steady images/s count from this share of a run's minibatches


def _emit(**fields):
    print(json.dumps({"benchmark": "wsp_straggler", **fields}), flush=True)


def slow_waves(scenario, waves, seed):
    """slow[w][c]: whether worker w runs wave c 2x slower."""
    import numpy as np

    if scenario == "transient":
        return (np.random.default_rng(seed).random((WORKERS, waves)) < 0.3).tolist()
    return [[w == 0] * waves for w in range(WORKERS)]


def wave_model_throughput(slow, d):
    """Waves per time unit of the plain wave model: worker i starts wave c once it finished wave
    c - 1 and every worker finished wave c - D - 1; a wave takes 1, or 2 when slowed."""
    waves = len(slow[0])
    finish = [[0.0] * waves for _ in slow]
    for c in range(waves):
        gate = max((finish[j][c - d - 1] for j in range(len(slow))), default=0.0) if c - d - 1 >= 0 else 0.0
        for i, row in enumerate(slow):
            start = max(finish[i][c - 1] if c else 0.0, gate)
            finish[i][c] = start + (2.0 if row[c] else 1.0)
    return len(slow) * waves / max(f[-1] for f in finish)


def _model(keras, width=256):
    return keras.Sequential([keras.Input((width,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(width, activation="relu"), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(10)])


def reference_times(model, names, data):
    """Stage times measured alone once, shared by every run (so that every D pads to the same
    targets, and the simulator predicts every D from the same times)."""
    import keras

    from hetpipe_tf.runtime.virtual_worker import VirtualWorker

    vw = VirtualWorker(model, ",".join(["1"] * STAGES), tf_devices=names[:STAGES],
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    vw.prepare(*data[0])
    return vw.references


def run_once(model, names, slow, d, steps, dilation, data, references):
    import keras

    from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
    from hetpipe_tf.runtime.wsp_runner import WSPRunner

    def slowdown(w):
        return lambda p: 2.0 if slow[w][(p - 1) // NM] else 1.0

    workers = [WorkerSpec(",".join(["1"] * STAGES), tuple(names[w * STAGES:(w + 1) * STAGES]), slowdown=slowdown(w))
               for w in range(WORKERS)]
    config = RunConfig(num_in_flight=NM, staleness_bound=d, optimizer=keras.optimizers.SGD(0.01), dilation=dilation,
                       timeout_s=300, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    runner = WSPRunner(model, workers, config, [names[0]])
    for vw in runner.vws:
        vw.references = references
    runner.train([data] * WORKERS, steps, trace=True)
    images_per_s = runner.images_per_s()
    from hetpipe_tf.pipeline.emulation import EmulationReport
    overrun = EmulationReport.combine(vw.emulation_report() for vw in runner.vws).overrun_fraction
    return runner, images_per_s, overrun


def synchronisation_times(events):
    """What the run's trace measured of its synchronisation, averaged over the run: seconds per
    (worker, stage) of its pushes' and merges' instructions on the stage, of a push's send to the
    servers (its lane), and of a pull's answer once the pushes it waited for had landed."""
    import collections
    import re

    spans = collections.defaultdict(list)
    landed, answers = {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        w, start, end = e["pid"], e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6
        if e["cat"] in ("PushUpdate", "MergePulled"):
            spans[(e["cat"], w, e["tid"])].append(end - start)
        elif e["cat"] == "Push":
            spans[("send", w, e["tid"] - 200)].append(end - start)
            landed[(w, e["tid"] - 200, int(e["name"].rsplit(" ", 1)[1]))] = end
        elif e["cat"] == "PullWait":
            gate, clock = map(int, re.findall(r"-?\d+", e["name"]))
            answers.append((w, e["tid"] - 100, gate, clock, start, end))
    mean = {key: sum(v) / len(v) for key, v in spans.items()}
    wave_landed = {}  # wave -> when its last push landed
    for (_, _, wave), t in landed.items():
        wave_landed[wave] = max(t, wave_landed.get(wave, t))
    latency = [answered - max(asked, landed[(w, s, clock)], wave_landed.get(gate, asked))
               for w, s, gate, clock, asked, answered in answers]
    return mean, sum(latency) / len(latency)


def steady_images_per_s(applied, first):
    """Images/s of every worker together after its update of minibatch `first`: the start of a
    run (its first calls, which trace the synchronisation's functions) left out. `applied`:
    {worker: {minibatch: when its first stage applied it}}."""
    rates = []
    for times in applied.values():
        last = max(times)
        rates.append(BATCH * (last - first) / (times[last] - times[first]))
    return sum(rates)


def measured_applied(events):
    """{worker: {minibatch: the end of its first stage's ApplyUpdate}} of a run's trace."""
    applied = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "ApplyUpdate" and e["tid"] == 0:
            p = int(e["name"][len("ApplyUpdate("):-1])
            applied.setdefault(e["pid"], {})[p] = (e["ts"] + e["dur"]) * 1e-6
    return applied


def predict(runner, events, slow, d, steps, dilation):
    """The simulator's images/s for the same schedules (over the whole run, and steady as
    :func:`steady_images_per_s` from minibatch :data:`STEADY_FROM` of `steps`): the forward and
    backward passes at their emulated times, the pushes, merges and pulls at the times the
    run's trace (`events`) measured."""
    from hetpipe_tf.pipeline.instructions import ApplyUpdate, Backward, Forward
    from hetpipe_tf.pipeline.simulator import simulate_workers
    from hetpipe_tf.sync.wsp import ParameterServerModel

    schedules = [vw.schedule(steps) for vw in runner.vws]
    measured, pull_s = synchronisation_times(events)

    def duration(agent, ins):
        w, s = agent
        if isinstance(ins, (Forward, Backward)):
            factor = 2.0 if slow[w][(ins.minibatch - 1) // NM] else 1.0
            return dilation * runner.vws[w].references[s][type(ins)] * factor
        return measured.get((type(ins).__name__, w, s), 0.0)

    servers = ParameterServerModel(d, push_time=lambda agent, ins: measured[("send",) + agent],
                                   pull_time=lambda agent, ins: pull_s)
    result = simulate_workers(schedules, duration, parameter_servers=servers)
    applied = {}
    for span in result.spans:
        if isinstance(span.instruction, ApplyUpdate) and span.stage[1] == 0:
            applied.setdefault(span.stage[0], {})[span.instruction.minibatch] = span.end
    return WORKERS * steps * BATCH / result.makespan, steady_images_per_s(applied, int(STEADY_FROM * steps))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waves", type=int, default=100, help="waves per virtual worker (Nm = 2 minibatches)")
    parser.add_argument("--dilation", type=float, default=20.0, help="emulated devices' time dilation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import tensorflow as tf

    from hetpipe_tf.planning.devices import DeviceSpec
    from hetpipe_tf.runtime.logical_devices import configure_tensorflow_devices

    tf.config.threading.set_intra_op_parallelism_threads(1)
    names = configure_tensorflow_devices([DeviceSpec("emulated")] * (WORKERS * STAGES))
    import keras
    import numpy as np

    keras.utils.set_random_seed(args.seed)
    model = _model(keras)
    rng = np.random.default_rng(args.seed)
    steps = args.waves * NM
    data = [(rng.normal(size=(BATCH, 256)).astype("float32"), rng.integers(0, 10, size=BATCH))
            for _ in range(steps)]
    references = reference_times(model, names, data)
    waits = {}
    for scenario in ("transient", "persistent"):
        slow = slow_waves(scenario, args.waves, args.seed)
        base = {}
        for d in BOUNDS:
            t0 = time.perf_counter()
            runner, images_per_s, overrun = run_once(model, names, slow, d, steps, args.dilation, data,
                                                     references)
            events = runner.trace.events()
            predicted, predicted_steady = predict(runner, events, slow, d, steps, args.dilation)
            steady = steady_images_per_s(measured_applied(events), int(STEADY_FROM * steps))
            model_rate = wave_model_throughput(slow, d)
            if d == 0:
                base = {"measured": images_per_s, "predicted": predicted, "wave_model": model_rate}
            stats = runner.stats()
            wait = sum(s["average_wait_s"] for s in stats) / len(stats)
            idle = sum(s["average_idle_s"] for s in stats) / len(stats)
            waits[(scenario, d)] = (wait, idle)
            _emit(scenario=scenario, staleness_bound=d, images_per_s=images_per_s,
                  ratio_to_d0=images_per_s / base["measured"], predicted_images_per_s=predicted,
                  predicted_ratio_to_d0=predicted / base["predicted"],
                  steady_images_per_s=steady, predicted_steady_images_per_s=predicted_steady,
                  predicted_over_measured_steady=predicted_steady / steady,
                  wave_model_ratio_to_d0=model_rate / base["wave_model"],
                  average_wait_s=wait, average_idle_s=idle,
                  virtual_workers=[{k: s[k] for k in ("worker", "average_wait_s", "average_idle_s", "images_per_s")}
                                   for s in stats],
                  slowed_waves_per_worker=[sum(row) for row in slow], waves=args.waves, num_in_flight=NM,
                  emulated=True, emulation="EMULATED devices (speed 1, dilation %g), 2x slowdowns" % args.dilation,
                  emulation_overrun_fraction=overrun, launch="in_process",
                  seconds=time.perf_counter() - t0)
    for scenario in ("transient", "persistent"):
        (w0, i0), (w4, i4) = waits[(scenario, 0)], waits[(scenario, 4)]
        _emit(scenario=scenario, summary=True, wait_ratio_d4_to_d0=w4 / w0 if w0 else None,
              paper_wait_ratio_d4_to_d0=0.62, idle_over_wait_d0=i0 / w0 if w0 else None,
              idle_over_wait_d4=i4 / w4 if w4 else None, paper_idle_over_wait=0.18,
              target="transient: ratio_to_d0 at D=4 >= 1.2; persistent: near 1")


if __name__ == "__main__":
    main()
