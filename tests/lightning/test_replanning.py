"""Planning again while training (runtime="local"): a memory limit lowered between steps."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from examples.models import loader
from lightning_pipe import MemoryPipeStrategy, RecoveryError
from tests.helpers import max_rel_diff, trainer
from tests.models import make

LIMIT = 654080  # the plan of the GPT family at 2 stages, 1F1B, micro-batches of 2, unconstrained: its fuller stage


class Shrink(Callback):
    """At step 2 of 5 every stage's limit drops by 30% (or to ``factor``), as when another job
    takes memory."""

    def __init__(self, strategy: MemoryPipeStrategy, factor: float = 0.7) -> None:
        self.strategy, self.factor, self.before = strategy, factor, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == 2:
            self.before = self.strategy.plan
            self.strategy.memory_limit = f"{int(LIMIT * self.factor)}B"
            self.strategy.meter.reset_peaks()  # from here on, the new plan's


@pytest.mark.slow
def test_a_lowered_memory_limit_is_planned_for_at_the_next_batch_and_training_goes_on_unchanged():
    torch.manual_seed(0)
    reference, data = make("gpt")
    trainer(max_steps=5).fit(reference, loader(data, 4))
    torch.manual_seed(0)
    model, _ = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, schedule="1f1b", measure_memory=True, memory_limit=LIMIT)
    shrink = Shrink(strategy)
    fit = trainer(strategy, 2, max_steps=5)
    fit.callbacks.append(shrink)
    fit.fit(model, loader(data, 4))
    limit = int(LIMIT * 0.7)
    assert strategy.memory_limit == [limit] and strategy.plan.targets == [limit, limit]
    assert shrink.before is not None and shrink.before.policies != strategy.plan.policies  # planned again
    assert all(m.peak <= limit for m in strategy.meter.stages)  # metered after the new plan
    assert max_rel_diff(model, reference) < 1e-5


def test_a_memory_limit_for_another_number_of_stages_is_refused_and_the_old_one_kept():
    strategy = MemoryPipeStrategy(chunks=2, planner=None, measure_memory=True, memory_limit="1GiB")
    trainer(strategy, 2, max_steps=1).fit(*_gpt())
    with pytest.raises(ValueError, match="memory_limit has 3 entries but there are 2 stage devices"):
        strategy.memory_limit = ["1GiB", "1GiB", "1GiB"]
    assert strategy.memory_limit == [2**30]


def test_a_memory_limit_lowered_below_any_plan_is_a_clear_error_and_the_last_checkpoint_is_intact(tmp_path):
    torch.manual_seed(0)
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, schedule="1f1b", measure_memory=True, memory_limit=LIMIT)
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1, save_top_k=0)
    fit = trainer(strategy, 2, max_steps=5, callbacks=[Shrink(strategy, factor=0.05), saving],
                  enable_checkpointing=True)
    limit = int(LIMIT * 0.05)
    with pytest.raises(RecoveryError, match=rf"No plan keeps every stage under memory_limit=\[{limit}\]: no plan "
                       r"fits: the smallest peak any plan reaches .* on stage \d .* Raise memory_limit"):
        fit.fit(model, loader(data, 4))
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2  # the steps before the limit was lowered
    reference, _ = make("gpt")
    trainer(max_steps=2).fit(reference, loader(data, 4))
    restored, _ = make("gpt")
    restored.load_state_dict(checkpoint["state_dict"])
    assert max_rel_diff(restored, reference) < 1e-5


def _gpt():
    model, data = make("gpt")
    return model, loader(data, 4)
