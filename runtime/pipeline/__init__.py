"""Pipeline parallelism: the executor that walks a rank's schedule (``executor``). The schedules
themselves are data, shared with the planner: ``runtime.contract.schedule_ir``."""
