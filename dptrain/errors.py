"""Errors that mean "the user asked for something we cannot do": printed as one line, exit 2."""


class UsageError(Exception):
    """Bad input from the user (a flag value, a file); the message names what is at fault."""


class RunStopped(Exception):
    """The run cannot go on (not the user's input): printed as one line, exit `exit_code`."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NonFiniteError(RunStopped):
    """A loss or gradient became NaN or infinite (and no skip was allowed): exit 3."""

    exit_code = 3
