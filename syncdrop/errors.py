"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class SyncdropError(Exception):
    """Bad input from the user (argument, file or model) with a message that names the problem."""
