"""Make the replay corpus's profiles (run once; the profiles are checked in).

    PYTHONPATH=. python tests/plan/corpus/make_profiles.py [names...]

Random chains from seeded generators, the project's model families at test scale profiled on
fake tensors, and GPT-2 small (with a small and with the full vocabulary) and large, BERT-large
and T5-large by fake execution with times for an A100-40GB, as ``lightning-pipe plan --devices
8xA100-40GB`` profiles them; BERT-large also as ``benchmarks/paper.py`` profiles it.
"""

import gzip
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks.paper import DEVICE, Bench, paper_models
from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.devices import DEVICES
from lightning_pipe.plan.profile import NodeProfile, Profile

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def chain(num_nodes: int, seed: int) -> Profile:
    """A random chain: node times and bytes drawn per node, a few long skips and residuals."""
    rnd = random.Random(seed)
    nodes = []
    for i in range(num_nodes):
        heavy = rnd.random() < 0.3
        f = rnd.uniform(0.05, 0.3) * (6 if heavy else 1)
        saved = int(rnd.uniform(0.2, 2.0) * (6 if heavy else 1) * MiB)
        params = int(rnd.uniform(0, 8) * MiB) if heavy else 0
        users = [i + 1] if i + 1 < num_nodes else [-1]
        if rnd.random() < 0.15 and i + 2 < num_nodes:
            users.append(rnd.randrange(i + 2, min(num_nodes, i + 12)))
        nodes.append(NodeProfile(f"n{i}", f, rnd.uniform(1.5, 2.5) * f, int(rnd.uniform(0.5, 2) * MiB), saved,
                                 int(rnd.uniform(0, 1) * MiB), params, params, 2 * params, users=sorted(users)))
    return Profile(nodes, "synthetic", "float32", 4, input_bytes=MiB, input_users=[0])


def fake_profile(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Profile:
    captured = capture(model.train(), example_inputs=(args, kwargs))
    return profile_graph(captured, args, kwargs, optimizer=torch.optim.Adam(model.parameters(), foreach=True),
                         fake=True, device=DEVICES["A100-40GB"])


def examples_gpt() -> Profile:
    from examples.models import GPT
    torch.manual_seed(0)
    batch = {"input_ids": torch.zeros(8, 64, dtype=torch.long)}
    return fake_profile(GPT(vocab=512, dim=128, heads=4, layers=6, context=64), (batch,), {})


def examples_unet() -> Profile:
    from examples.models import UNet
    torch.manual_seed(0)
    return fake_profile(UNet(channels=16, depth=3), (torch.zeros(8, 3, 64, 64),), {})


def examples_encdec() -> Profile:
    from examples.models import EncoderDecoder
    torch.manual_seed(0)
    src = torch.zeros(8, 32, dtype=torch.long)
    return fake_profile(EncoderDecoder(vocab=256, dim=128, layers=4), (src, src), {})


def gpt2_small() -> Profile:
    """GPT-2 small's shape as ``lightning-pipe plan --model examples.hf_gpt2.GPT2LM --init-args
    '{"layers": 12, "dim": 768, "context": 1024}' --input input_ids=int64[16,1024] --input
    labels=int64[16,1024] --devices 8xA100-40GB`` profiles it (4 micro-batches: one of 4)."""
    from examples.hf_gpt2 import GPT2LM
    torch.manual_seed(0)
    model = GPT2LM(layers=12, dim=768, context=1024)
    ids = torch.zeros(4, 1024, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    captured = capture(model.train(), example_inputs=((), batch))
    return profile_graph(captured, (), batch, optimizer=model.configure_optimizers(), fake=True,
                         device=DEVICES["A100-40GB"])


def hf(cls: Callable[[Any], torch.nn.Module], config: Any, seq: int, microbatch: int) -> Callable[[], Profile]:
    def make() -> Profile:
        with torch.device("meta"):
            model = cls(config)
        ids = torch.zeros(microbatch, seq, dtype=torch.long)
        return fake_profile(model, (), {"input_ids": ids, "labels": ids})

    return make


t = transformers
MAKERS: dict[str, Callable[[], Profile]] = {
    **{f"chain{n}_s{seed}": (lambda n=n, seed=seed: chain(n, seed)) for n, seed in ((60, 1), (150, 2), (400, 3))},
    "gpt": examples_gpt,
    "unet": examples_unet,
    "encdec": examples_encdec,
    "gpt2_small": gpt2_small,
    "gpt2_lmhead": hf(t.GPT2LMHeadModel, t.GPT2Config(use_cache=False), 1024, 4),
    "gpt2_large": hf(t.GPT2LMHeadModel, t.GPT2Config(n_layer=36, n_embd=1280, n_head=20, use_cache=False), 1024, 2),
    "bert_large": hf(t.BertForMaskedLM, t.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                                     intermediate_size=4096), 512, 2),
    # BERT-large as benchmarks/paper.py profiles it (tests/plan/test_complete.py's infeasible case)
    "paper_bert": lambda: Bench(paper_models()["bert"], DEVICE).profile,
    "t5_large": hf(t.T5ForConditionalGeneration,
                   t.T5Config(d_model=1024, d_ff=4096, num_layers=24, num_decoder_layers=24, num_heads=16, d_kv=64,
                              use_cache=False, decoder_start_token_id=0, pad_token_id=0), 512, 2),
}


def main(names: list[str]) -> None:
    for name in names or list(MAKERS):
        profile = MAKERS[name]()
        with gzip.open(HERE / f"{name}.json.gz", "wt") as f:
            f.write(profile.to_json())
        print(name, len(profile.nodes), "nodes", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
