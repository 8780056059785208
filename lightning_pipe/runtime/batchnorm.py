"""Deferred BatchNorm: running statistics over the whole batch, not per micro-batch.

Under micro-batching a BatchNorm layer sees one micro-batch per call, so stock BatchNorm moves
``running_mean``/``running_var`` once per micro-batch towards that micro-batch's statistics:
``chunks`` updates per batch, each from fewer samples, unlike single-device training. A
converted layer (torchgpipe's ``DeferredBatchNorm``) keeps each micro-batch's mean and
variance and, once the batch is done, makes the one update single-device training makes:
towards the whole batch's mean and unbiased variance. Each micro-batch is still normalised
with its own statistics; whole-batch normalisation would need every micro-batch's forward
before any stage could go on.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pipe.internals import BatchNormBase, check_input_dim, current_graph_task_id

__all__ = ["DeferredBatchNorm", "batch_norm_layers"]


def batch_norm_layers(module: nn.Module) -> dict[str, BatchNormBase]:
    """The BatchNorm layers below ``module`` that keep running statistics, by name."""
    return {
        name: m for name, m in module.named_modules() if isinstance(m, BatchNormBase) and m.track_running_stats
    }


class DeferredBatchNorm:
    """``module``'s BatchNorm layers, converted in place until :meth:`restore`.

    Each layer's ``forward`` is shadowed by an instance attribute: the layers keep their
    class, parameters and buffers, so ``state_dict`` keys stay the plain module's and torch.fx
    still traces each layer as one ``torch.nn`` leaf. In training a layer records each
    micro-batch's statistics; :meth:`commit` at the end of a batch updates the running ones.
    """

    def __init__(self, module: nn.Module) -> None:
        self.layers = [_Layer(m) for m in batch_norm_layers(module).values()]
        for layer in self.layers:
            vars(layer.module)["forward"] = layer

    def commit(self) -> None:
        """Update every layer's running statistics with those of the micro-batches it saw."""
        for layer in self.layers:
            layer.commit()

    def discard(self) -> None:
        """Forget what the layers recorded, e.g. the profiler's runs of a micro-batch."""
        for layer in self.layers:
            layer.tracked.clear()

    def restore(self) -> None:
        """Give the layers back their own ``forward``."""
        for layer in self.layers:
            vars(layer.module).pop("forward", None)


class _Layer:
    """The shadowing ``forward`` of one BatchNorm layer, and what it recorded this batch."""

    def __init__(self, module: BatchNormBase) -> None:
        self.module = module
        self.tracked: list[tuple[int, Tensor, Tensor]] = []  # (values per channel, mean, unbiased var)

    def __call__(self, input: Tensor) -> Tensor:
        bn = self.module
        if not bn.training:
            return type(bn).forward(bn, input)
        check_input_dim(bn, input)
        assert bn.running_mean is not None and bn.running_var is not None
        # With momentum 1 the kernel writes the micro-batch's mean and unbiased variance here.
        mean, var = torch.zeros_like(bn.running_mean), torch.zeros_like(bn.running_var)
        output = F.batch_norm(input, mean, var, bn.weight, bn.bias, True, 1.0, bn.eps)
        if current_graph_task_id() == -1:  # else a backward recomputes a recorded micro-batch
            self.tracked.append((input.numel() // input.shape[1], mean, var))
        return output

    def commit(self) -> None:
        """One running-statistics update, as ``_BatchNorm.forward`` makes it for a whole batch:
        the micro-batches' statistics combined exactly (Chan et al.'s parallel variance)."""
        if not self.tracked:
            return
        bn = self.module
        assert bn.running_mean is not None and bn.running_var is not None and bn.num_batches_tracked is not None
        means = torch.stack([m for _, m, _ in self.tracked])
        sizes = torch.tensor([n for n, _, _ in self.tracked], dtype=means.dtype, device=means.device)[:, None]
        variances = torch.stack([v for _, _, v in self.tracked])
        self.tracked.clear()
        total = sizes.sum()
        mean = (sizes * means).sum(0) / total
        var = ((sizes - 1) * variances + sizes * (means - mean).square()).sum(0) / (total - 1)
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
            bn.running_mean.mul_(1 - factor).add_(factor * mean)
            bn.running_var.mul_(1 - factor).add_(factor * var)
