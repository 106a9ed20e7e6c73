"""The base of the planner package's input errors.

Each layer of ``planner`` raises its own subclass (``ModelError`` in the front end, ``SearchError``
in the search, ``PlanError`` for plan.json, ``CalibrationError`` ...); the CLI lists them with the
other packages' error types (``planner.cli.user_errors``) and turns each into one paragraph on
stderr and exit status 2.
"""


class UserError(ValueError):
    """Bad input from the user: the message says what was wrong and what to do."""
