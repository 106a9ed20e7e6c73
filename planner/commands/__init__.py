"""The CLI's drivers: one module per command (``plan``, ``compile``, ``train``, ``validate``,
``calibrate``, ``export``), each with a ``run_<command>(args)`` that ``planner.cli`` dispatches to.
They sit on top of every other layer and hold no logic another command needs."""
