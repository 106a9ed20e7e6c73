"""The one exception type the CLI turns into a clean message and exit code 2."""


class UserError(ValueError):
    """Bad input from the user: the message says what was wrong and what to do."""
