"""How long a Hugging Face model takes to capture, profile and plan: GPT-2 medium (24 layers,
d=1024, ~355M parameters) on this machine's CPU.

    python -m benchmarks.hf_capture [--layers 24 --dim 1024 --heads 16]

The model is built on the meta device: torch.export captures on meta stand-ins and a fake
profile runs on fake tensors, so neither needs the weights, and a model too large for the
host can be planned. Capture is torch.export's (fx cannot trace GPT-2); the profile measures
bytes on fake tensors (times are estimated for an A100-40GB). Targets: capture plus profile under 60 s, planning
over 8 stages under 1 s.
"""

import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.plan import PLANNING_HEADROOM, make_plan
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.units import format_bytes, parse_bytes


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_capture", description=__doc__)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sample")
    parser.add_argument("--microbatch", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=16, help="micro-batches per batch (1F1B)")
    parser.add_argument("--memory", default="4GiB", help="each stage device's memory limit")
    args = parser.parse_args(argv)

    config = GPT2Config(n_layer=args.layers, n_embd=args.dim, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.seq, use_cache=False)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    model.train()
    ids = torch.zeros(args.microbatch, args.seq, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids}

    start = time.perf_counter()
    captured = capture(model, example_inputs=((), inputs))
    captured_at = time.perf_counter()
    profile = profile_graph(captured, (), inputs, optimizer=torch.optim.AdamW(model.parameters()), fake=True)
    profiled_at = time.perf_counter()
    targets = [int(parse_bytes(args.memory) * PLANNING_HEADROOM)] * args.stages
    plan = make_plan(profile, PlanRequest(targets, "dawnpiper", "1f1b", args.chunks))
    planned_at = time.perf_counter()

    result = {
        "capture_s": captured_at - start,
        "profile_s": profiled_at - captured_at,
        "plan_s": planned_at - profiled_at,
        "nodes": len(captured.nodes),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    recomputed = sum(p == "recompute" for p in plan.policies)
    print(f"GPT-2 {args.layers} layers, d={args.dim}: {result['parameters'] / 1e6:.0f}M parameters, "
          f"{result['nodes']} graph nodes ({captured.front_end})")
    print(f"capture {result['capture_s']:.1f} s, fake profile {result['profile_s']:.1f} s "
          f"(micro-batch {args.microbatch} x {args.seq} tokens); target: under 60 s together -> "
          f"{'met' if result['capture_s'] + result['profile_s'] < 60 else 'MISSED'}")
    print(f"plan over {args.stages} x {format_bytes(parse_bytes(args.memory))} (1f1b, {args.chunks} micro-batches): "
          f"{result['plan_s']:.2f} s, balance {plan.balance}, {recomputed} nodes recomputed; "
          f"target: under 1 s -> {'met' if result['plan_s'] < 1 else 'MISSED'}")
    return result


if __name__ == "__main__":
    main()
