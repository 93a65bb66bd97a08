"""Errors users can act on. The CLI prints them as one line and exits with `exit_code`."""


class HvtrainError(Exception):
    """An error caused by user input or environment, reported without a traceback."""

    exit_code = 2


class ConfigError(HvtrainError):
    """Bad experiment config: the message starts with `file:line: key.path:`."""


class HostfileError(HvtrainError):
    """Bad hostfile or host list: the message starts with `file:line:`."""


class LaunchError(HvtrainError):
    """The launch cannot start (missing launcher, too many ranks for the slots, ...)."""


class DataError(HvtrainError):
    """A dataset cannot be loaded or does not fit the model."""


class BackendUnavailable(HvtrainError):
    """The selected backend's framework or Horovod build is missing."""


PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later" (sbatch --requeue, or a wrapper, resubmits)


class Preempted(HvtrainError):
    """The job stopped on a signal after checkpointing; rank 0 already said where."""

    exit_code = PREEMPTED_EXIT
