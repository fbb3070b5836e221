"""The train step's named sums: added per micro-batch, reduced across ranks as before."""

import math

import torch

from burstrl.trainer.loop import LossSums


class _TwoRanks:
    """A stand-in for `Dist` whose other rank holds the same figures."""

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.mul_(2)

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def test_add_sums_every_figure_and_keeps_the_largest_ratio():
    sums = LossSums()
    sums.add(LossSums(loss=0.5, tokens=3, ratio=3.3, clipped=1, truncated=0, kl=0.25, ratio_max=1.2))
    sums.add(LossSums(loss=0.25, tokens=2, ratio=1.9, clipped=0, truncated=1, kl=0.5, ratio_max=0.9))
    assert sums == LossSums(loss=0.75, tokens=5, ratio=3.3 + 1.9, clipped=1, truncated=1, kl=0.75, ratio_max=1.2)


def test_a_nan_ratio_max_stays_nan():
    sums = LossSums()
    sums.add(LossSums(ratio_max=float("nan")))
    sums.add(LossSums(ratio_max=2.0))
    assert math.isnan(sums.ratio_max)


def test_all_reduce_sums_the_sums_and_maxes_the_max():
    sums = LossSums(loss=1.0, tokens=4, ratio=4.4, clipped=1, truncated=2, kl=0.125, ratio_max=1.5)
    sums.all_reduce(_TwoRanks())
    assert sums == LossSums(loss=2.0, tokens=8, ratio=8.8, clipped=2, truncated=4, kl=0.25, ratio_max=1.5)
