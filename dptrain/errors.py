"""Errors that mean "the user asked for something we cannot do": printed as one line, exit 2."""


class UsageError(Exception):
    """Bad input from the user (a flag value, a file); the message names what is at fault."""


class RunStopped(Exception):
    """The run cannot go on (not the user's input): printed as one line, exit `exit_code`."""

    exit_code = 1
    # True where every rank raises it after the same step (a signal's agreed stop, a
    # non-finite step seen through an all-reduce): the job then ends with `exit_code` on
    # every rank, one message from rank 0, and no MPI abort (whose banner and exit code
    # differ between MPI flavours).
    agreed = False

    def __init__(self, message: str, exit_code: int | None = None, agreed: bool | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        if agreed is not None:
            self.agreed = agreed


class NonFiniteError(RunStopped):
    """A loss or gradient became NaN or infinite (and no skip was allowed): exit 3."""

    exit_code = 3
    agreed = True  # the non-finite flags are all-reduced: every rank sees the same step


class BadArgument(UsageError, ValueError):
    """A bad argument to a library call (a learning rate, a batch size, labels): a ValueError
    for code that catches those, and one line with exit code 2 under ``dptrain.launch``."""


class AgreedUsageError(UsageError):
    """A UsageError that every rank raises at the same point (the same flags, a check rank 0
    made and shared): under mpirun rank 0 alone prints it and ends with exit 2, the other
    ranks end quietly, and no MPI abort is needed."""
