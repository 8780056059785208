import json
import socket
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.plan import Plan, fitting_plan, make_plan
from lightning_pipe.plan.profile import NodeProfile, Profile
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.sharding import block_of
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


def test_stages_keep_their_parameters_gathered_unless_memory_binds():
    roomy = make_plan(decoder(), request(4 * GIB))
    assert [s.reshard_after_forward for s in roomy.stages] == [False, False]
    tight = make_plan(decoder(), request(int(1.6 * GIB)))
    assert [s.reshard_after_forward for s in tight.stages] == [True, True]
    assert max(s.peak.total for s in tight.stages) < min(s.peak.total for s in roomy.stages)
    assert tight.step_ms > roomy.step_ms  # two all-gathers per micro-batch, against one per step


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


@pytest.mark.slow  # two processes of FSDP2 on gloo: about 15 s of CPU
def test_the_predicted_peak_is_within_a_tenth_of_real_fsdp2_on_two_ranks(tmp_path):
    torch.manual_seed(0)
    model, x = fsdp_ranks.Blocks(), fsdp_ranks.batch()
    with torch.no_grad():
        captured = capture(model, example_inputs=((x,), {}))
    profile = profile_graph(captured, (x,), optimizer=fsdp_ranks.optimizer(model), repeats=1, warmup=0)
    mp.spawn(fsdp_ranks.rank, args=(2, str(tmp_path), _free_port()), nprocs=2)
    for reshard in (True, False):
        # a link makes gathering once per step faster: the stage keeps its parameters gathered
        plan = make_plan(profile, PlanRequest([64 * GIB], "dawnpiper", "1f1b", 1, None, None if reshard else 1e9,
                                              replicas=2, data_parallel="fsdp"))
        stage = plan.stages[0]
        assert stage.reshard_after_forward is reshard and len(stage.fsdp_units) == fsdp_ranks.BLOCKS
        for rank in range(2):
            measured = json.loads((tmp_path / f"rank{rank}.json").read_text())[str(reshard)]
            assert stage.peak.total == pytest.approx(measured, rel=0.1)
