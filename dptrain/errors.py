"""Errors that mean "the user asked for something we cannot do": printed as one line, exit 2."""


class UsageError(Exception):
    """Bad input from the user (a flag value, a file); the message names what is at fault."""
