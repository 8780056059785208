"""Record the replay corpus's expected answers from the planner on the path (run once, on the
code whose answers are the reference):

    PYTHONPATH=<checkout> python tests/plan/corpus/record.py [profiles...]

Given profiles, only their cases are recorded, the others' kept.
"""

import json
import sys
import time
from typing import Any

from replay import EXPECTED, answer, name, profile

from lightning_pipe.plan.devices import DEVICES
from lightning_pipe.plan.memory import CostModel, stage_ranges
from lightning_pipe.plan.partitioners import partition
from lightning_pipe.plan.plan import PLANNING_HEADROOM
from lightning_pipe.plan.schedule import in_flight

A100 = DEVICES["A100-40GB"]
SCHEDULES = ("gpipe", "1f1b", "2bw")
# (profile, stages, chunks, schedules, host and link bandwidth)
SETS: list[tuple[str, int, int, tuple[str, ...], float | None, float | None]] = [
    ("chain60_s1", 4, 8, SCHEDULES, None, None),
    ("chain150_s2", 8, 16, SCHEDULES, 16e9, None),
    ("chain400_s3", 16, 32, SCHEDULES, None, None),
    ("gpt", 4, 4, SCHEDULES, A100.host_bandwidth, A100.link_bandwidth),
    ("unet", 4, 4, SCHEDULES, A100.host_bandwidth, None),
    ("encdec", 4, 4, SCHEDULES, None, A100.link_bandwidth),
    ("gpt2_lmhead", 8, 8, ("gpipe", "1f1b"), A100.host_bandwidth, A100.link_bandwidth),
    ("gpt2_small", 8, 4, ("gpipe",), A100.host_bandwidth, A100.link_bandwidth),
    ("gpt2_large", 8, 16, ("1f1b",), A100.host_bandwidth, A100.link_bandwidth),
    ("bert_large", 8, 8, ("gpipe",), A100.host_bandwidth, A100.link_bandwidth),
    ("t5_large", 8, 8, ("2bw",), A100.host_bandwidth, A100.link_bandwidth),
]
CAPS = {"loose": 0.9, "tight": 0.7}  # of the compute-balanced split's fullest stage, all activations kept
MAX_MICROBATCH = {"chain150_s2", "gpt", "unet", "gpt2_large", "gpt2_lmhead", "gpt2_small"}


def capacity(name: str, stages: int, chunks: int, schedule: str, share: float) -> int:
    prof = profile(name)
    flight = in_flight(schedule, chunks, stages)
    model = CostModel(prof)
    timed = partition("time", prof, [1 << 60] * stages, flight)
    return int(share * max(model.peak(r.start, r.stop, flight[s]).total for s, r in enumerate(stage_ranges(timed))))


def cases() -> list[dict[str, Any]]:
    found = []
    for prof, stages, chunks, schedules, host, link in SETS:
        for schedule in schedules:
            for cap, share in CAPS.items():
                capacities = [capacity(prof, stages, chunks, schedule, share)] * stages
                for partitioner in ("dawnpiper", "capslog"):
                    for memopt in (True, False):
                        found.append({"profile": prof, "stages": stages, "schedule": schedule, "chunks": chunks,
                                      "partitioner": partitioner, "memopt": memopt, "cap": cap,
                                      "capacities": capacities, "host_bandwidth": host, "link_bandwidth": link,
                                      "kind": "plan"})
        if prof in MAX_MICROBATCH:
            for partitioner in ("dawnpiper", "capslog"):
                planned = int(A100.memory * PLANNING_HEADROOM) if prof.startswith("gpt2") else \
                    capacity(prof, stages, chunks, schedules[-1], 1.0)
                found.append({"profile": prof, "stages": stages, "schedule": schedules[-1], "chunks": chunks,
                              "partitioner": partitioner, "memopt": True, "cap": "device",
                              "capacities": [planned] * stages, "host_bandwidth": host, "link_bandwidth": link,
                              "kind": "max_microbatch"})
    return found


def main(only: list[str]) -> None:
    recorded = [c for c in json.loads(EXPECTED.read_text()) if c["profile"] not in only] if only else []
    for case in cases():
        if only and case["profile"] not in only:
            continue
        start = time.perf_counter()
        case["answer"] = answer(case)
        case["seconds"] = round(time.perf_counter() - start, 3)
        print(f"{case['seconds']:8.2f} s {name(case)}", flush=True)
        recorded.append(case)
    EXPECTED.write_text(json.dumps(recorded, indent=0) + "\n")
    print(len(recorded), "cases,", sum(c["seconds"] for c in recorded), "s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
