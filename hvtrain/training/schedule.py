"""The learning-rate schedule: linear warmup to the (optionally world-scaled) rate, indexed by the
position in this world's steps, so a resume on another world size continues the same schedule.
"""

from __future__ import annotations

from hvtrain.config.schema import Config


class LRSchedule:
    """Base lr, times the data-parallel width if `scale_lr`, reached by linear warmup over
    `warmup_epochs`. With scale_lr the warmup starts at the single-rank lr (Goyal et al., 2017);
    without it, at zero. Called with the step in this world's units (`schedule_step`)."""

    def __init__(self, cfg: Config, replicas: int, steps_per_epoch: int):
        o = cfg.optimizer
        self.target = o.lr * (replicas if o.scale_lr else 1)
        self.start = o.lr if o.scale_lr else 0.0
        self.warmup_steps = int(round(o.warmup_epochs * steps_per_epoch))

    def __call__(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.target
        return self.start + (self.target - self.start) * (step + 1) / self.warmup_steps


def schedule_step(epoch: int, offset: int, steps_per_epoch: int, step_samples: int) -> int:
    """The LR schedule's step at a position (`offset` samples into `epoch`) in this world's units:
    the epochs done times this world's steps per epoch, plus the steps `offset` takes at
    `step_samples` a step. Not the run's step counter: a checkpoint (or elastic reset) of
    another world size counted its steps in that world's, so 4 ranks -> 1 rank past the warmup
    re-entered it (warmup_steps is 4x larger at 1 rank). On one world size the two agree."""
    return epoch * steps_per_epoch + -(-offset // step_samples)
