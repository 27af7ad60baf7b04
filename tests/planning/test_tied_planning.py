"""Planning a model whose layer is called in several places (tied input and output embeddings):
its profile counts the layer once per stage that calls it, and the planner weighs replicas
(their memory and the exchange of their gradients) against keeping the calls on one stage, and
says which it chose."""
import dataclasses
import itertools
import json

import pytest

from hetpipe_tf.planning.cluster import PRESETS, load_cluster
from hetpipe_tf.planning.cost_model import LinkModel
from hetpipe_tf.planning.planner import PlanError, _Costs, _plan, plan
from hetpipe_tf.planning.profile import Profile, coarsen, colocated
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.runtime.profiler import model_profile as profile_of
from hetpipe_tf.runtime.stage_rewrite import describe_model
from tests.helpers.models import gpt2_causal_lm
from tests.helpers.profiles import model_profile

MIB = 2 ** 20


def _tied(profile, segments, nbytes):
    """`profile` with a layer of `nbytes` called in `segments` (each counts it, as profiles do)."""
    weights = list(profile.weight_bytes)
    for i in segments:
        weights[i] += nbytes
    return dataclasses.replace(profile, weight_bytes=tuple(weights), shared_weights=(("tied", tuple(segments), nbytes),))


def _cluster(devices, memory="12G"):
    """One node of `devices` TITAN Vs (the paper's preset) of `memory` each."""
    spec = json.loads(json.dumps(PRESETS["paper"]))
    spec["device_types"]["V"]["memory"] = memory
    spec["nodes"] = [{"name": "n0", "device_type": "V", "count": devices}]
    return load_cluster(spec)


def test_a_stage_counts_a_tied_layer_once_and_each_stage_that_calls_it_a_replica():
    graph = describe_model(gpt2_causal_lm()).graph
    profile = profile_of(gpt2_causal_lm(), 4)
    (layer, segments, nbytes), = profile.shared_weights
    assert layer.endswith("token_embedding") and segments == (0, profile.num_segments - 1) and nbytes > 0
    assert graph.allowed_cuts() == ()  # no cut keeps the embedding's two calls together
    n = profile.num_segments
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, n), k) for k in range(3)):
        bounds = (0,) + cuts
        ends = cuts + (n,)
        assert [profile.stage_weight_bytes(lo, hi) for lo, hi in zip(bounds, ends)] == [
            trainable for trainable, _ in graph.stage_weight_bytes(bounds)], bounds
        holds = [any(lo <= s < hi for s in segments) for lo, hi in zip(bounds, ends)]
        assert [profile.replicated_bytes(lo, hi) for lo, hi in zip(bounds, ends)] == [
            nbytes if held and sum(holds) > 1 else 0 for held in holds], bounds
    # The parameter servers hold one copy, pushed by the first stage that holds one.
    assert sum(profile.server_bytes) == profile.total_weight_bytes and profile.server_bytes[-1] == 0
    # Merged segments keep one copy: the model's weights are the same whichever way it is cut.
    for merged in (colocated(profile), coarsen(profile, 3)):
        assert merged.total_weight_bytes == profile.total_weight_bytes < sum(profile.weight_bytes)
    assert colocated(profile).num_segments == 1 and colocated(profile).shared_weights == ()
    assert Profile.from_json(profile.to_json()) == profile


def test_the_planner_replicates_a_tied_layer_that_no_cut_keeps_together_and_says_so():
    profile = _tied(model_profile(), (0, 11), 200 * MIB)
    chosen = plan(profile, _cluster(2), PlanRequest(policy="ed", vw_size=2))
    stages = chosen.to_dict()["virtual_workers"][0]["stages"]
    assert [s["replicas"] for s in stages] == [["tied"], ["tied"]]
    # Each holds the replica's weights (with its versions and slots) and receives the other's gradient.
    for st in chosen.workers[0].partition.stages:
        weights = profile.stage_weight_bytes(*st.segments)
        assert st.exchange > 0 and weights >= 200 * MIB
        assert st.memory["weights and versions"] % weights == 0 and st.memory["optimizer slots"] == weights
    assert "tied replicated on worker 0's stages 0, 1" in chosen.notes[-1]
    assert "the plan with each kept on one stage does not fit" in chosen.notes[-1]


def test_the_planner_keeps_a_tied_layers_calls_on_one_stage_when_that_is_faster():
    # Two neighbouring calls of a large layer: a replica each would exchange 400 MiB a minibatch.
    profile = _tied(model_profile(), (5, 6), 400 * MIB)
    request = PlanRequest(policy="ed", vw_size=3)
    chosen = plan(profile, _cluster(3), request)
    replicated = _plan(profile, _cluster(3), request, _Costs(LinkModel(), 1, None))
    kept = _plan(colocated(profile), _cluster(3), request, _Costs(LinkModel(), 1, None))
    assert chosen.minibatches_per_s == max(replicated.minibatches_per_s, kept.minibatches_per_s)
    assert chosen.minibatches_per_s > 0
    stage = next(st for st in chosen.workers[0].partition.stages if st.segments[0] <= 5 < st.segments[1])
    assert stage.segments[1] > 6 and all(st.exchange == 0 for st in chosen.workers[0].partition.stages)
    assert "tied on one stage" in chosen.notes[-1] and "the plan with " in chosen.notes[-1]


def test_a_tied_model_that_fits_nowhere_gets_the_planners_error():
    profile = _tied(model_profile(), (0, 11), 200 * MIB)
    with pytest.raises(PlanError, match="does not fit devices"):
        plan(profile, _cluster(2, memory="1500M"), PlanRequest(policy="ed", vw_size=2))
