import socket
from dataclasses import replace

import pytest
import torch.multiprocessing as mp
from torch import nn

from lightning_pipe.plan.plan import Plan, fitting_plan, make_plan, planning_stages
from lightning_pipe.plan.profile import NodeProfile, Profile, block_of
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.sharding import Sharding
from lightning_pipe.runtime.fsdp import planned_shardings, sharding
from tests.plan import fsdp_ranks

GIB = 2**30


def decoder(layers=8, params=100 * 2**20, saved=40 * 2**20):
    """An embedding, ``layers`` blocks of two parameter nodes each, a head: names as fx gives
    a decoder's (``layers_3_...``), every block holding ``params`` bytes, Adam's state twice."""
    names = ["embed"] + [f"layers_{k}_{part}" for k in range(layers) for part in ("attn_linear", "mlp_linear")] + [
        "head_linear"]
    nodes = []
    for i, name in enumerate(names):
        p = params // 2
        nodes.append(NodeProfile(name, 1.0, 2.0, saved, saved, 0, p, p, 2 * p,
                                 users=[i + 1] if i + 1 < len(names) else [-1]))
    return Profile(nodes, "cuda", "torch.float32", 1, input_bytes=1024, input_users=[0])


def request(capacity, stages=2, **changes):
    return replace(PlanRequest([capacity] * stages, "dawnpiper", "1f1b", 4, None, 1e11, replicas=4,
                               data_parallel="fsdp"), **changes)


def test_fsdp_holds_a_quarter_of_the_state_over_four_replicas_and_plans_what_ddp_cannot():
    profile = decoder()
    assert fitting_plan(profile, request(2 * GIB, data_parallel="ddp", replicas=1)) is None  # 1.8 GB of state a stage
    plan = make_plan(profile, request(2 * GIB))
    assert plan.data_parallel == "fsdp" and plan.replicas == 4
    assert all(s.peak.total <= 2 * GIB for s in plan.stages)
    assert Plan.from_json(plan.to_json()) == plan


def test_each_stage_records_its_blocks_as_fsdp_units():
    plan = make_plan(decoder(), request(2 * GIB))
    first = plan.stages[0]
    names = plan.nodes
    for start, stop in first.fsdp_units:  # one block each, the embedding left to the stage's own unit
        assert len({block_of(n) for n in names[start:stop]}) == 1
    assert [len(s.fsdp_units) for s in plan.stages] == [sum(1 for n in set(map(block_of, names[s.start:s.stop])) if n)
                                                         for s in plan.stages]
    assert sum(len(s.fsdp_units) for s in plan.stages) == 8
    small = make_plan(decoder(params=2**20), request(2 * GIB))  # 8 MiB a stage: gathered as one unit
    assert all(s.fsdp_units == [] for s in small.stages)


def test_stages_keep_their_parameters_gathered_where_resharding_after_forward_saves_nothing():
    # pipelining keeps every block gathered from its first backward to the step's end
    # (set_reshard_after_backward(False)): resharded after forward, a later backward gathers
    # each block again beside those after it, so under 1F1B its peak is higher, and it is slower
    profile, asked = decoder(), request(4 * GIB, optimise_memory=False, carry=True)
    plan = make_plan(profile, asked)
    assert [s.reshard_after_forward for s in plan.stages] == [False, False]
    kept, again = (planning_stages(profile, asked, sharding=Sharding(profile, 4, 4, 1e11, resharded))
                   for resharded in (False, True))
    assert [o.peak.total for o in kept.pruned(plan.balance)] == [s.peak.total for s in plan.stages]
    assert all(a.peak.total > k.peak.total for a, k in zip(again.pruned(plan.balance), kept.pruned(plan.balance)))
    assert all(a.forward + a.backward > k.forward + k.backward
               for a, k in zip(again.times(plan.balance), kept.times(plan.balance)))


def _named_like_decoder(layers=8):
    """Modules whose graph names are :func:`decoder`'s nodes' (``layers.3.attn_linear`` is ``layers_3_attn_linear``)."""
    root = nn.Module()
    root.embed = nn.Linear(2, 2)
    root.layers = nn.ModuleList(nn.ModuleDict({"attn_linear": nn.Linear(2, 2), "mlp_linear": nn.Linear(2, 2)})
                                for _ in range(layers))
    root.head_linear = nn.Linear(2, 2)
    return root


@pytest.mark.parametrize(("params", "split"), [(100 * 2**20, True), (2**20, False)])
def test_the_runtime_shards_each_stage_into_the_units_its_plan_chose(params, split):
    plan = make_plan(decoder(params=params), request(4 * GIB, optimise_memory=False, carry=True))
    root, planned = _named_like_decoder(), planned_shardings(plan)
    assert planned is not None and len(planned) == len(plan.stages)
    for report, chosen in zip(plan.stages, planned):
        blocks = sorted({int(b.split("_")[1]) for n in plan.nodes[report.start:report.stop] if (b := block_of(n))})
        made = sharding(nn.ModuleList(root.layers[k] for k in blocks), root, chosen)
        assert made.reshard_after_forward is report.reshard_after_forward is False
        expected = [list(root.layers[k].values()) for k in blocks] if split else []
        assert made.units == expected
    assert planned_shardings(make_plan(decoder(), request(4 * GIB, data_parallel="ddp", replicas=1))) is None


def test_ddp_plans_say_nothing_of_sharding():
    plan = make_plan(decoder(), request(4 * GIB, data_parallel="ddp"))
    assert plan.data_parallel == "ddp" and all(s.reshard_after_forward is None and not s.fsdp_units
                                               for s in plan.stages)


@pytest.mark.parametrize(("changes", "message"), [
    ({"replicas": 1}, "replicas >= 2"),
    ({"schedule": "2bw"}, "schedule '1f1b' or 'gpipe'"),
    ({"data_parallel": "zero"}, "data_parallel must be one of 'ddp', 'fsdp'"),
])
def test_fsdp_requests_that_cannot_shard_are_refused_naming_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        request(GIB, **changes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # eight processes of FSDP2 on gloo: 79 s of CPU (55 user, 24 system), planning included
def test_predicted_peaks_are_within_a_tenth_of_real_fsdp2_in_a_pipeline_at_pp2_dp4(tmp_path):
    # pp=2 x dp=2 runs in the four-rank launch (tests/lightning/test_distributed.py). Measured:
    # +0.1% kept gathered, +8.1% resharded (its later backwards' gathering again and their
    # gradients made before they are added are priced as if at once)
    made = fsdp_ranks.write_plans(tmp_path, 2, 4)
    assert {key: [s.reshard_after_forward for s in p.stages] for key, p in made.items()} == {
        "False": [False, False], "True": [True, True]}
    assert all(len(s.fsdp_units) == fsdp_ranks.BLOCKS // 2 for p in made.values() for s in p.stages)
    mp.spawn(fsdp_ranks.spawned, args=(8, 2, str(tmp_path), _free_port()), nprocs=8)
    for key, rank, predicted, measured in fsdp_ranks.compared(tmp_path, 2, 4):
        assert predicted == pytest.approx(measured, rel=0.1), (key, rank)
