"""Pipeline x FSDP at paper scale: the largest Llama-style decoder (layers at a fixed width) the
planner fits on 8, 16 and 32 A100-80GB with pipeline stages and DDP replicas, pipeline stages
sharded by FSDP over their replicas, and FSDP alone (one stage), each at its best depth.

Run by ``python -m benchmarks.paper --fsdp``. Cheap by construction: a decoder of three layers
is built from ``transformers.LlamaConfig`` on the meta device and profiled once on fake tensors
(bf16-mixed, Adam as a GPU steps it, the A100's roofline); a model of ``L`` layers is that
profile with its middle layer's nodes repeated (:func:`repeated`), planned, never run: the
figures are the planner's predictions (no FSDP runtime runs fake yet).
"""

import math
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import transformers

from lightning_pipe.plan.devices import DEVICES
from lightning_pipe.plan.plan import PLANNING_HEADROOM, plan_fits
from lightning_pipe.plan.profile import NodeProfile, Profile, block_of
from lightning_pipe.plan.request import PlanRequest

DEVICE = DEVICES["A100-80GB"]
GPUS = (8, 16, 32)
SEQ = 4096
# Llama 2 70B's width: at it a model of every GPU's memory has at most a few hundred layers
WIDTH = {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
         "vocab_size": 32000}
MODES = ("pp + DDP", "pp x FSDP", "FSDP")
#: CPU seconds a probe may take: one that fits takes under one at these sizes; one that does not
#: may search recompute policies over thousands of nodes for many minutes, and counts as not fitting.
PROBE_CPU_S = 3.0


def llama(layers: int) -> Any:
    """The paper-scale workload: a Llama decoder of ``layers`` at :data:`WIDTH`, sequence :data:`SEQ`."""
    from benchmarks.paper import Workload, _hf, _hf_loss, _keywords, _tokens

    config = transformers.LlamaConfig(**WIDTH, num_hidden_layers=layers, max_position_embeddings=SEQ,
                                      use_cache=False)
    label = f"Llama, {layers} layers, hidden {WIDTH['hidden_size']}, seq {SEQ}"  # (Bench profiles once per label)
    return Workload("llama", label, _hf(transformers.LlamaForCausalLM, config), _tokens(SEQ), _keywords, _hf_loss)


def three_layers() -> Profile:
    """The fake profile of a three-layer decoder at one sequence per micro-batch."""
    from benchmarks.paper import Bench

    return Bench(llama(3), DEVICE, "bf16-mixed").profile.scaled(1)


def repeated(profile: Profile, layers: int) -> Profile:
    """``profile`` (a decoder of three layers) with its middle layer repeated to ``layers`` in
    all. The first and last layers stay themselves (the first saves first what every layer
    reads; the last is the one the head reads). A copy's references to its own layer, the one
    before and the one after move with it; references to what follows the copies move by the
    nodes added; a node before the layers that the middle layer reads is read by every copy."""
    names = [block_of(n.name) for n in profile.nodes]
    order = list(dict.fromkeys(name for name in names if name is not None))
    if len(order) != 3 or layers < 3:
        raise ValueError(f"repeated takes a profile of 3 layers and layers >= 3, got {len(order)} and {layers}.")
    a, b, c = (names.index(name) for name in order)
    d = len(names) - names[::-1].index(order[2])
    if not c - b == b - a == d - c:
        raise ValueError("the layers' node counts differ: this profile's layers are not alike.")
    width, extra = c - b, (layers - 3) * (c - b)

    def before(r: int) -> int:  # from a node before the copies
        return r + extra if r >= c else r

    def after(r: int) -> int:  # from a node after them
        return r + extra if r >= b else r

    stem = order[1].rsplit("_", 1)[0]  # model_layers

    def copied(p: NodeProfile, layer: int, move: Callable[[int], int]) -> NodeProfile:
        def at(r: int) -> int:
            return r if r < 0 else move(r)

        block = block_of(p.name)
        name = p.name if block is None else f"{stem}_{layer}{p.name[len(block):]}"
        return replace(p, name=name, users=[at(u) for u in p.users],
                       held_until=at(p.held_until), held_by=at(p.held_by), last_saver=at(p.last_saver),
                       saved_inputs_from=at(p.saved_inputs_from), forwarded_grads=[at(f) for f in p.forwarded_grads])

    nodes = [copied(p, 0, before) for p in profile.nodes[:b]]
    for i in range(a):  # read by every copy
        users = nodes[i].users
        nodes[i].users = sorted({u + k * width for u in users if b <= u < c for k in range(layers - 2)}
                                | {u for u in users if not b <= u < c})
    for k in range(layers - 2):
        offset = k * width
        nodes += [copied(p, 1 + k, lambda r, o=offset: r + o if a <= r < d else r + extra if r >= d else r)
                  for p in profile.nodes[b:c]]
    nodes += [copied(p, layers - 1, after) for p in profile.nodes[c:]]
    return replace(profile, nodes=nodes, input_users=[before(u) for u in profile.input_users], shared=[])


@dataclass
class Largest:
    """One mode on one GPU count: the most layers that fit, at which depth, and per depth."""

    gpus: int
    mode: str
    layers: int  # 0: not even 3 fit
    stages: int
    params_b: float  # billions of parameters at ``layers``
    by_depth: dict[int, int]


def request(gpus: int, stages: int, mode: str) -> PlanRequest:
    """Stages as processes, 1F1B over one micro-batch per stage, recompute allowed, each stage
    planned to the device's memory times the headroom; the other GPUs the stages' replicas."""
    replicas = gpus // stages
    return PlanRequest([int(DEVICE.memory * PLANNING_HEADROOM)] * stages, "dawnpiper", "1f1b", stages, None,
                       DEVICE.link_bandwidth, carry=True, replicas=replicas,
                       data_parallel="ddp" if mode == "pp + DDP" else "fsdp")


def depths(gpus: int, mode: str) -> list[int]:
    """The pipeline depths tried for a mode on ``gpus`` (fewer than every power of two, to keep
    the run short): with DDP the deepest three (the model grows with the depth: each stage holds
    its layers' whole state), sharded 2, 4 and 8 stages with at least two replicas each, FSDP
    alone one."""
    if mode == "FSDP":
        return [1]
    if mode == "pp + DDP":
        return [gpus // 4, gpus // 2, gpus]
    return [s for s in (2, 4, 8) if s <= gpus // 2]


def largest_fitting(fits: Callable[[int], bool], start: int) -> int:
    """The largest count from ``start`` that ``fits`` takes (layers, a micro-batch's size:
    fitting is monotone in it), by doubling then bisection; 0: not even ``start``."""
    if not fits(start):
        return 0
    low, high = start, 2 * start
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


class _Slow(Exception):
    pass


def _raise(*_: Any) -> None:
    raise _Slow


def fits(profile: Profile, layers: int, asked: PlanRequest) -> bool:
    """Whether ``layers`` fit, a probe over :data:`PROBE_CPU_S` counting as not."""
    previous = signal.signal(signal.SIGPROF, _raise)
    signal.setitimer(signal.ITIMER_PROF, PROBE_CPU_S)
    try:
        return plan_fits(repeated(profile, layers), asked)
    except _Slow:
        return False
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


_FOUND: dict[tuple[int, str, int], int] = {}  # (stages, mode, replicas) -> most layers


def largest(profile: Profile, gpus: int, mode: str, progress: Callable[[str], None] = print) -> Largest:
    """The most layers ``mode`` fits on ``gpus`` at each depth, and the best. DDP's replicas
    hold what one does (but the gradient bucket their reduction copies): found once per depth."""
    per_layer = _layer_params(profile)
    by_depth = {}
    for stages in depths(gpus, mode):
        asked = request(gpus, stages, mode)
        key = (stages, mode, asked.replicas if mode != "pp + DDP" else min(asked.replicas, 2))
        if key not in _FOUND:
            _FOUND[key] = largest_fitting(lambda layers, asked=asked: fits(profile, layers, asked), max(3, stages))
        by_depth[stages] = _FOUND[key]
        progress(f"{gpus} GPUs, {mode}, {stages} stages: {by_depth[stages]} layers")
    stages = max(by_depth, key=lambda s: (by_depth[s], -s))
    layers = by_depth[stages]
    base = sum(n.param_bytes for n in profile.nodes) - 3 * per_layer
    return Largest(gpus, mode, layers, stages, (base + layers * per_layer) / 4 / 1e9, by_depth)


def _layer_params(profile: Profile) -> int:
    """Parameter bytes of one layer (fp32)."""
    names = [block_of(n.name) for n in profile.nodes]
    middle = [name for name in dict.fromkeys(names) if name is not None][1]
    return sum(n.param_bytes for n, name in zip(profile.nodes, names) if name == middle)


def run(gpus: Sequence[int] = GPUS, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every mode on every GPU count: the results ``benchmarks.paper`` saves under ``"fsdp"``."""
    profile = three_layers()
    rows = [largest(profile, g, mode, progress) for g in gpus for mode in MODES]
    return {"device": DEVICE.name, "seq": SEQ, "width": WIDTH, "rows": [vars(r) for r in rows]}


def section(results: dict[str, Any]) -> str:
    """The page's section on these results: a table and the plot."""
    rows = [Largest(**{**r, "by_depth": {int(k): v for k, v in r["by_depth"].items()}}) for r in results["rows"]]
    by = {(r.gpus, r.mode): r for r in rows}
    gpus = sorted({r.gpus for r in rows})
    lines = ["| GPUs | " + " | ".join(f"{m}: layers (B params, stages)" for m in MODES) + " | pp x FSDP / pp + DDP |",
             "|" + "---|" * (len(MODES) + 2)]
    for g in gpus:
        cells = [f"{by[g, m].layers} ({by[g, m].params_b:.1f}B, {by[g, m].stages})" for m in MODES]
        ratio = by[g, "pp x FSDP"].params_b / by[g, "pp + DDP"].params_b if by[g, "pp + DDP"].layers else math.inf
        lines.append(f"| {g} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    depth_lines = ["| GPUs | mode | " + " | ".join(f"{s} stages" for s in sorted({s for r in rows for s in r.by_depth}))
                   + " |"]
    every = sorted({s for r in rows for s in r.by_depth})
    depth_lines.append("|" + "---|" * (len(every) + 2))
    for r in rows:
        depth_lines.append(f"| {r.gpus} | {r.mode} | " + " | ".join(
            str(r.by_depth.get(s, "–")) for s in every) + " |")  # noqa: RUF001
    width = results["width"]
    return "\n\n".join([
        "## Pipeline x FSDP: the largest decoder",
        f"Generated by `python -m benchmarks.paper --fsdp`. A Llama-style decoder "
        f"(`transformers.LlamaConfig`: hidden {width['hidden_size']}, MLP {width['intermediate_size']}, "
        f"{width['num_attention_heads']} heads, vocabulary {width['vocab_size']}) at sequence {results['seq']}, "
        f"bf16-mixed, Adam, one sequence per micro-batch, 1F1B with one micro-batch per stage, stages as "
        f"processes, recompute allowed, on {results['device']}: the most layers whose plan fits "
        f"{PLANNING_HEADROOM:.0%} of every GPU. *pp + DDP*: stages, each copied whole on the other GPUs; "
        "*pp x FSDP*: stages sharded by FSDP over their replicas (at least two); *FSDP*: one stage sharded over "
        "every GPU. Each at the best of the depths tried (in brackets; every one below). Planner predictions on a "
        "three-layer profile whose middle layer is repeated, not fake runs (no FSDP runtime runs fake yet); a "
        f"probe taking over {PROBE_CPU_S:g} s of CPU counts as not fitting, so each figure is a lower bound.",
        "\n".join(lines),
        "Most layers per pipeline depth:",
        "\n".join(depth_lines),
        "![largest decoder per mode](img/fsdp-scale.png)",
        "Read: the target (pp x FSDP at least twice the model pp + DDP trains on the same GPUs) cannot be met, "
        "by arithmetic. Per parameter under bf16-mixed with Adam a stage holds 16 bytes (fp32 parameter and "
        "gradient, two moments); on G GPUs, *pp + DDP* at its best depth (G stages, no copies) holds 16 N / G "
        "bytes of an N-parameter model per GPU. *pp x FSDP* at S stages, each sharded over R = G / S replicas, "
        "holds 12 N / G sharded (parameter and moments) and, as `torch.distributed.pipelining` runs FSDP2, "
        "each stage whole near the step's last backward: its parameters gathered in bf16 and its gradients "
        "accumulated unsharded in fp32 (6 N / S), 6 N / S + 12 N / G in all: at R = 2 24 N / G, at R = 4 "
        "36 N / G, never under 16 N / G; so by state pp x FSDP fits at most 16 / (6 R + 12) of what the deepest "
        "pipeline fits (0.67 at R = 2). *FSDP* alone (one stage) holds the whole model gathered, 6 N + 12 N / G. "
        "Even a runtime reduce-scattering and resharding after every micro-batch (FSDP2 outside a pipeline) "
        "would hold 16 N / G and a block or two gathered: the same as the deepest pipeline, a ratio of at most 1. "
        "Activations do not change this: under 1F1B with at least S micro-batches the first stage holds S "
        "micro-batches of its L / S layers, one micro-batch of every layer at any depth, and sharding divides "
        "no activations. A deeper pipeline divides the parameters by the GPUs as sharding does; what sharding "
        "buys is a shallower pipeline at a fixed model (a smaller bubble, fewer micro-batches to fill it, "
        "fewer layers than GPUs), not a larger model. The table bears this out: pp x FSDP's best is at its "
        "deepest depth tried (8 stages), under pp + DDP's best on every GPU count (0.72, 0.78, 0.94 of it). At "
        "the same depth sharding pays as 16 / S against 6 / S + 12 / G bytes a parameter says: at 8 stages "
        "32 layers with DDP's copies, 43 sharded over 2 replicas (x1.33 predicted, x1.34 found), 59 over 4 "
        "(x1.78, x1.84). pp + DDP at 16 and 32 stages is held down by the probe's CPU cap (the partitioner's "
        "search for a split of 16 or 32 stages takes longer than it), so its figures there are lower bounds "
        "and the last column overstates sharding's share (once checked without the cap: 100 layers on 32 "
        "stages do not fit, so 32 GPUs' pp + DDP lies between 63 and 99 layers).",
    ])


def plot(results: dict[str, Any], path: Path) -> None:
    """The largest model per mode against the GPU count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        rows = sorted((r for r in results["rows"] if r["mode"] == mode), key=lambda r: r["gpus"])
        axes.plot([r["gpus"] for r in rows], [r["params_b"] for r in rows], marker="o", label=mode)
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(GPUS), [str(g) for g in GPUS])
    axes.set_xlabel(f"GPUs ({results['device']})")
    axes.set_ylabel("largest decoder (billion parameters)")
    axes.set_title(f"Llama-style decoder, seq {results['seq']}, bf16-mixed, Adam")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
