"""The paper's cluster at full scale: the planner and simulator beside HetPipe's Table 4 and Fig. 4.

Pure prediction: nothing trains. Keras builds VGG-19 and ResNet-152 (224x224, 1000
classes, no weights) only to read their graphs; their costs on the paper's GPUs (Table 1,
preset ``paper``) are analytic (a roofline of each GPU's peak FP32 and memory bandwidth).
Every cell of Table 4 (1, 2, 3 and 4 GPU types: HetPipe ED-local with four virtual
workers, one on 4[V]; Horovod on every GPU that holds the model) and of Fig. 4 (NP, ED, HD
with default placement, ED-local and Horovod on all 16 GPUs, D = 0) is predicted and
printed as a JSON line beside the paper's number, with its relative error.

What the paper does not give is calibrated, each on one cell, and every other cell is a
prediction:

* the fraction of peak FP32 a model's kernels reach, per model, on its HetPipe 4[V] cell
  (one virtual worker on one node: no inter-node link, no parameter server);
* the inter-node link's effective bandwidth (§7 fits that link to measurements too), on
  VGG-19's HetPipe 4[VR] cell;
* the rate Horovod's ring all-reduce reaches on an edge inside a node (PCIe, §8.1), on
  VGG-19's Horovod 4[V] cell (one node; its all-reduce outlasts the backward pass it
  overlaps, so the cell measures that rate);
* the rate it reaches on an edge between nodes (InfiniBand, §8.1; the ring moves at its
  slowest edge), on VGG-19's Horovod 4[VR] cell.

Horovod's steps use the same compute efficiency as HetPipe's (the same kernels on the
same GPUs): no Horovod cell calibrates it.

Fig. 4's bars carry no numbers in the paper's text: its Horovod and ED-local bars are the
Table 4 cells of the same cluster (ED-local is 1.8x Horovod for VGG-19 and 1.4x for
ResNet-152, §8.3), and for NP, ED and HD the text's statements are checked instead.

A transformer the paper did not train: a GPT-2-medium-sized language model
(keras_hub's GPT2Backbone, 24 blocks of 1,024, 16 heads, a Dense head over the 50,257-token
vocabulary: 406M parameters), sequences of 1,024 tokens, 2 per minibatch, AdamW (two slots per
weight), predicted on the same cluster for NP, ED, HD, ED-local and Horovod, in tokens/s, with
the links and all-reduce rates calibrated above and the analytic compute efficiency's default
(0.5: no cell of the paper calibrates it). Its attention blocks keep their scores (16 x 1,024 x
1,024 per block and sequence) for the backward pass, so on the 6 GB GeForce RTX 2060s memory, not
speed, decides the cut: the same plans with 12 GB G cards are printed beside them.

    python benchmarks/paper_scale.py [--out=benchmarks/results/paper_scale.jsonl]
                                     [--png=benchmarks/results/paper_scale.png] [--skip_transformer]
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# HetPipe (Park et al., USENIX ATC 2020), Table 4: images/s, batch 32 per minibatch;
# HetPipe's cells also give the total number of concurrent minibatches.
TABLE_4 = {
    "vgg19": {"horovod": {"V": 164, "VR": 205, "VRQ": 265, "VRQG": 339},
              "hetpipe": {"V": (300, 5), "VR": (530, 16), "VRQ": (572, 20), "VRQG": (606, 20)}},
    "resnet152": {"horovod": {"V": 233, "VR": 353, "VRQ": 415, "VRQG": None},  # None: X, G cannot hold it
                  "hetpipe": {"V": (256, 5), "VR": (516, 20), "VRQ": (538, 24), "VRQG": (580, 28)}},
}
COLUMN = {"V": "4[V]", "VR": "4[VR]", "VRQ": "4[VRQ]", "VRQG": "4[VRQG]"}
# §8.3: bytes crossing nodes, ED-local per minibatch and Horovod per step (MB as the paper writes).
CROSS_NODE_MB = {"vgg19": {"ed-local": 103, "horovod": 515}, "resnet152": {"ed-local": 298, "horovod": 211}}
CALIBRATION = {"compute_efficiency": "hetpipe V (each model)", "inter_node_scale": ("vgg19", "hetpipe", "VR"),
               "allreduce_intra_node_GBps": ("vgg19", "horovod", "V"),
               "allreduce_inter_node_GBps": ("vgg19", "horovod", "VR")}

HOROVOD_CALIBRATION_CELLS = {CALIBRATION["allreduce_intra_node_GBps"], CALIBRATION["allreduce_inter_node_GBps"]}


def _emit(out, **fields):
    line = json.dumps({"benchmark": "paper_scale", "emulated": False, **fields})
    print(line, flush=True)
    if out:
        out.write(line + "\n")


def _error(predicted, paper):
    return round((predicted - paper) / paper, 4)


def _profiles():
    import keras

    from hetpipe_tf.cli.models import build_model
    from hetpipe_tf.planning.profile import static_profile
    from hetpipe_tf.runtime.stage_rewrite import describe_model

    out = {}
    for name in TABLE_4:
        model = build_model(name, (224, 224, 3), 1000)
        out[name] = static_profile(describe_model(model).graph, 32)
        del model
        keras.backend.clear_session()
    return out


TRANSFORMER = {"name": "gpt2_medium", "batch_size": 2, "sequence_length": 1024, "optimizer_slots": 2}  # AdamW


def _transformer_profile():
    from hetpipe_tf.cli.hetpipe import build_transformer
    from hetpipe_tf.runtime.profiler import model_profile

    return model_profile(build_transformer(TRANSFORMER["name"]), TRANSFORMER["batch_size"],
                         sequence_length=TRANSFORMER["sequence_length"])


def _cluster(types):
    from hetpipe_tf.planning.cluster import with_device_types

    return with_device_types("paper", types)


class Model:
    """The planner's and the all-reduce model's settings, with what is calibrated."""

    def __init__(self, profiles):
        from hetpipe_tf.planning.cost_model import LinkModel

        self.profiles = profiles
        self.efficiency = {name: 0.5 for name in profiles}
        self.inter_scale = LinkModel().inter_scale
        self.allreduce_bandwidth = {"intra": None, "inter": None}  # bytes/s; None: the links' own

    def links(self):
        from hetpipe_tf.planning.cost_model import LinkModel

        return LinkModel(inter_scale=self.inter_scale,
                         source=f"0.8 of PCIe inside a node; {self.inter_scale:.3f} of InfiniBand between nodes")

    def hetpipe(self, name, types, policy="ed", placement="local"):
        from hetpipe_tf.planning.planner import plan
        from hetpipe_tf.planning.request import PlanRequest
        from hetpipe_tf.planning.profile import AnalyticAssumptions

        cluster = _cluster(types)
        assume = AnalyticAssumptions(compute_efficiency=self.efficiency[name])
        if types == "V":  # Table 4's 4[V]: one virtual worker of the node's four GPUs
            return plan(self.profiles[name], cluster, PlanRequest(workers=[cluster.devices()]), analytic=assume,
                        links=self.links())
        return plan(self.profiles[name], cluster, PlanRequest(policy=policy, placement=placement), analytic=assume,
                    links=self.links())

    def horovod(self, name, types):
        from hetpipe_tf.planning.data_parallel import AllReduceModel, predict_data_parallel
        from hetpipe_tf.planning.profile import AnalyticAssumptions

        allreduce = AllReduceModel(intra_node_bandwidth=self.allreduce_bandwidth["intra"],
                                   inter_node_bandwidth=self.allreduce_bandwidth["inter"])
        return predict_data_parallel(self.profiles[name], _cluster(types), links=self.links(), allreduce=allreduce,
                                     analytic=AnalyticAssumptions(compute_efficiency=self.efficiency[name]))


def _bisect(set_value, measure, target, lo, hi, rounds=14):
    """The value in [lo, hi] at which measure() (growing with the value) meets target."""
    for _ in range(rounds):
        mid = (lo + hi) / 2
        set_value(mid)
        if measure() < target:
            lo = mid
        else:
            hi = mid
    set_value((lo + hi) / 2)
    return (lo + hi) / 2


def calibrate(model):
    """Sets the unknowns, each on its one cell (module docstring), in an order in which no
    cell depends on one calibrated after it."""
    for name in model.profiles:
        _bisect(lambda v, n=name: model.efficiency.__setitem__(n, v),
                lambda n=name: model.hetpipe(n, "V").images_per_s, TABLE_4[name]["hetpipe"]["V"][0], 0.05, 1.0)
    name, _, types = CALIBRATION["inter_node_scale"]
    _bisect(lambda v: setattr(model, "inter_scale", v), lambda: model.hetpipe(name, types).images_per_s,
            TABLE_4[name]["hetpipe"][types][0], 0.02, 1.0)
    for edge in ("intra", "inter"):
        name, _, types = CALIBRATION[f"allreduce_{edge}_node_GBps"]
        _bisect(lambda v, e=edge: model.allreduce_bandwidth.__setitem__(e, v * 1e9),
                lambda n=name, t=types: model.horovod(n, t).images_per_s, TABLE_4[name]["horovod"][types], 0.1, 20.0)


def _cross_node_bytes(p):
    """Bytes of one minibatch that cross nodes in worker 0 of plan `p` (activations forward,
    gradients back)."""
    part = p.workers[0].partition
    return sum(2 * p.profile.cut_bytes[st.segments[0]] for q, st in enumerate(part.stages)
               if q > 0 and st.device.node != part.stages[q - 1].device.node)


def table_4(model, out):
    cells = []
    for name, systems in TABLE_4.items():
        for types, column in COLUMN.items():
            paper_ips, paper_mb = systems["hetpipe"][types]
            p = model.hetpipe(name, types)
            calibrated = types == "V" or (name, "hetpipe", types) == CALIBRATION["inter_node_scale"]
            cell = {"model": name, "config": column, "system": "hetpipe ED-local" if types != "V" else "hetpipe",
                    "predicted_images_per_s": round(p.images_per_s, 1), "paper_images_per_s": paper_ips,
                    "error": _error(p.images_per_s, paper_ips), "calibration_cell": calibrated,
                    "predicted_concurrent_minibatches": p.num_in_flight * len(p.workers),
                    "paper_concurrent_minibatches": paper_mb, "allocation": p.allocation,
                    "cross_node_MiB_per_minibatch": round(_cross_node_bytes(p) / 2 ** 20, 1)}
            cells.append(cell)
            _emit(out, figure="table 4", **cell)
            paper = systems["horovod"][types]
            try:
                h = model.horovod(name, types)
            except ValueError as e:
                cell = {"model": name, "config": column, "system": "horovod", "predicted_images_per_s": None,
                        "paper_images_per_s": paper, "error": None if paper is None else -1.0,
                        "calibration_cell": False, "reason": str(e)}
            else:
                cell = {"model": name, "config": column, "system": "horovod",
                        "predicted_images_per_s": round(h.images_per_s, 1), "paper_images_per_s": paper,
                        "error": _error(h.images_per_s, paper) if paper else None,
                        "calibration_cell": (name, "horovod", types) in HOROVOD_CALIBRATION_CELLS,
                        "gpus": len(h.devices), "left_out": [d.name for d in h.left_out],
                        "compute_ms": round(h.compute_seconds * 1e3, 1),
                        "backward_ms": round(h.backward_seconds * 1e3, 1),
                        "allreduce_ms": round(h.allreduce_seconds * 1e3, 1), "step_ms": round(h.step_seconds * 1e3, 1),
                        "sent_per_gpu_MiB": round(h.bytes_sent_per_device / 2 ** 20, 1)}
                if paper is None:
                    cell["note"] = "the paper's X: Horovod cannot use the G GPUs; predicted without them"
            cells.append(cell)
            _emit(out, figure="table 4", **cell)
    return cells


def figure_4(model, out):
    """Fig. 4 (D = 0, all 16 GPUs): NP, ED, HD, ED-local and Horovod, with the text's claims."""
    cells, checks = [], {}
    for name in TABLE_4:
        row = {}
        for label, policy, placement in (("NP", "np", "default"), ("ED", "ed", "default"), ("HD", "hd", "default"),
                                         ("ED-local", "ed", "local")):
            p = model.hetpipe(name, "VRQG", policy, placement)
            row[label] = p.images_per_s
            paper = TABLE_4[name]["hetpipe"]["VRQG"][0] if label == "ED-local" else None
            cell = {"model": name, "system": label, "predicted_images_per_s": round(p.images_per_s, 1),
                    "paper_images_per_s": paper, "error": _error(p.images_per_s, paper) if paper else None,
                    "num_in_flight": p.num_in_flight, "allocation": p.allocation}
            cells.append(cell)
            _emit(out, figure="fig 4", **cell)
        h = model.horovod(name, "VRQG")
        row["Horovod"] = h.images_per_s
        paper = TABLE_4[name]["horovod"]["VRQ" if name == "resnet152" else "VRQG"]
        cell = {"model": name, "system": "Horovod", "predicted_images_per_s": round(h.images_per_s, 1),
                "paper_images_per_s": paper, "error": _error(h.images_per_s, paper), "gpus": len(h.devices)}
        cells.append(cell)
        _emit(out, figure="fig 4", **cell)
        ratio = row["ED-local"] / row["Horovod"]
        paper_ratio = {"vgg19": 1.8, "resnet152": 1.4}[name]
        checks[f"{name}: ED-local / Horovod (paper {paper_ratio})"] = round(ratio, 2)
        if name == "vgg19":
            checks["vgg19: Horovod beats NP, ED and HD"] = all(row[k] < row["Horovod"] for k in ("NP", "ED", "HD"))
        else:
            checks["resnet152: ED and HD within 15 % of Horovod"] = all(
                abs(row[k] / row["Horovod"] - 1) <= 0.15 for k in ("ED", "HD"))
        checks[f"{name}: NP is the lowest policy"] = row["NP"] == min(row[k] for k in ("NP", "ED", "HD", "ED-local"))
    _emit(out, figure="fig 4", checks=checks)
    return cells, checks


def _stages_on(p, device_type):
    """The stages of worker 0's kind on `device_type` in plan `p`: their layers, time and memory."""
    names = p.profile.layer_names
    out = []
    for w in p.workers:
        for st in w.partition.stages:
            if st.device.type.name == device_type:
                end = p.profile.starts[st.segments[1]] if st.segments[1] < p.profile.num_segments else len(names)
                out.append({"layers": f"{names[p.profile.starts[st.segments[0]]]}..{names[end - 1]}",
                            "time_ms": round(st.time * 1e3, 1), "memory_GiB": round(st.memory_total / 2 ** 30, 2),
                            "capacity_GiB": round(st.capacity / 2 ** 30, 2)})
        if out:
            return out
    return out


def transformer(model, profile, out):
    """The GPT-2-medium-sized model on the paper's cluster and on it with 12 GB G cards: NP, ED, HD,
    ED-local and Horovod (module docstring)."""
    from hetpipe_tf.planning.cluster import PRESETS, load_cluster
    from hetpipe_tf.planning.data_parallel import AllReduceModel, predict_data_parallel
    from hetpipe_tf.planning.planner import PlanError, plan
    from hetpipe_tf.planning.request import PlanRequest

    spec = json.loads(json.dumps(PRESETS["paper"]))
    spec["device_types"]["G"]["memory"] = "12G"
    tokens = TRANSFORMER["sequence_length"]
    rows = []
    for label, cluster in (("paper", load_cluster("paper")), ("paper, G with 12 GB", load_cluster(spec))):
        for system, policy, placement in (("NP", "np", "default"), ("ED", "ed", "default"), ("HD", "hd", "default"),
                                          ("ED-local", "ed", "local")):
            row = {"model": TRANSFORMER["name"], "cluster": label, "system": system}
            try:
                p = plan(profile, cluster, PlanRequest(policy=policy, placement=placement), links=model.links(),
                         optimizer_slots=TRANSFORMER["optimizer_slots"])
            except PlanError as e:
                row.update(predicted_tokens_per_s=None, reason=str(e).splitlines()[-1][:300])
            else:
                row.update(predicted_tokens_per_s=round(p.images_per_s * tokens), num_in_flight=p.num_in_flight,
                           allocation=p.allocation, stages_on_G=_stages_on(p, "G"))
            rows.append(row)
            _emit(out, figure="transformer", **row)
        allreduce = AllReduceModel(intra_node_bandwidth=model.allreduce_bandwidth["intra"],
                                   inter_node_bandwidth=model.allreduce_bandwidth["inter"])
        row = {"model": TRANSFORMER["name"], "cluster": label, "system": "Horovod"}
        try:
            h = predict_data_parallel(profile, cluster, links=model.links(), allreduce=allreduce,
                                      optimizer_slots=TRANSFORMER["optimizer_slots"])
        except ValueError as e:
            row.update(predicted_tokens_per_s=None, reason=str(e))
        else:
            row.update(predicted_tokens_per_s=round(h.images_per_s * tokens), gpus=len(h.devices),
                       left_out=sorted({d.type.name for d in h.left_out}), step_ms=round(h.step_seconds * 1e3, 1),
                       allreduce_ms=round(h.allreduce_seconds * 1e3, 1))
        rows.append(row)
        _emit(out, figure="transformer", **row)
    paper = {r["system"]: r["predicted_tokens_per_s"] for r in rows if r["cluster"] == "paper"}
    roomy = {r["system"]: r["predicted_tokens_per_s"] for r in rows if r["cluster"] != "paper"}
    gains = {k: round(roomy[k] / paper[k] - 1, 3) for k in paper if paper[k] and roomy[k] and k != "Horovod"}
    best = max((k for k in paper if k != "Horovod" and paper[k]), key=lambda k: paper[k])
    _emit(out, figure="transformer", summary=True, best_hetpipe=best,
          best_hetpipe_over_horovod=round(paper[best] / paper["Horovod"], 2) if paper["Horovod"] else None,
          gain_with_12GB_G_cards=gains)
    return rows


def plot(cells, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = [c for c in cells if c["paper_images_per_s"] and c["predicted_images_per_s"]]
    fig = Figure(figsize=(12, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"{c['model']}\n{c.get('config', 'fig 4')}\n{c['system'].replace('hetpipe ', '')}" for c in rows]
    x = range(len(rows))
    colours = {"paper": "#1f77b4", "predicted": "#d62728", "calibrated on this cell": "#bbbbbb"}
    ax.bar([i - 0.2 for i in x], [c["paper_images_per_s"] for c in rows], 0.4, color=colours["paper"])
    ax.bar([i + 0.2 for i in x], [c["predicted_images_per_s"] for c in rows], 0.4,
           color=[colours["calibrated on this cell" if c.get("calibration_cell") else "predicted"] for c in rows])
    for i, c in zip(x, rows):
        ax.text(i + 0.2, c["predicted_images_per_s"], f"{c['error']:+.0%}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=5)
    ax.set_ylabel("images/s")
    ax.set_title("HetPipe Table 4 on the paper's cluster: paper vs planner + simulator (analytic, not emulated)")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/paper_scale.jsonl")
    parser.add_argument("--png", default="benchmarks/results/paper_scale.png")
    parser.add_argument("--skip_transformer", action="store_true", help="leave out the GPT-2-medium-sized rows")
    args = parser.parse_args()
    model = Model(_profiles())
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out:
        calibrate(model)
        _emit(out, calibrated={"compute_efficiency": {k: round(v, 3) for k, v in model.efficiency.items()},
                               "inter_node_scale": round(model.inter_scale, 3),
                               "inter_node_GBps": round(7.0 * model.inter_scale, 2),
                               **{f"allreduce_{k}_node_GBps": round(v / 1e9, 2)
                                  for k, v in model.allreduce_bandwidth.items()}},
              calibrated_on={"compute_efficiency": "each model's HetPipe 4[V] cell",
                             "inter_node_scale": "VGG-19 HetPipe 4[VR]",
                             "allreduce_intra_node_GBps": "VGG-19 Horovod 4[V]",
                             "allreduce_inter_node_GBps": "VGG-19 Horovod 4[VR]"})
        cells = table_4(model, out)
        fig4, checks = figure_4(model, out)
        for name, volumes in CROSS_NODE_MB.items():
            p = model.hetpipe(name, "VRQG")
            h = model.horovod(name, "VRQG" if name == "vgg19" else "VRQ")
            n = len(h.devices)
            _emit(out, check="bytes across nodes (§8.3)", model=name,
                  ed_local_predicted_MiB=round(_cross_node_bytes(p) / 2 ** 20, 1),
                  ed_local_paper_MB=volumes["ed-local"],
                  horovod_predicted_MiB=round((n - 1) / n * h.gradient_bytes / 2 ** 20, 1),
                  horovod_paper_MB=volumes["horovod"])
        predicted = [c for c in cells if not c["calibration_cell"] and c["error"] is not None]
        summary = {}
        for system in ("hetpipe", "horovod"):
            errs = [c["error"] for c in predicted if c["system"].startswith(system)]
            summary[system] = {"cells_predicted": len(errs), "max_abs_error": max(abs(e) for e in errs),
                               "within_15_percent": sum(abs(e) <= 0.15 for e in errs)}
        _emit(out, summary=True, table_4=summary, fig_4_checks=checks)
        if not args.skip_transformer:
            transformer(model, _transformer_profile(), out)
    if args.png:
        plot(cells + [c for c in fig4 if c["system"] not in ("ED-local", "Horovod")], args.png)


if __name__ == "__main__":
    main()
