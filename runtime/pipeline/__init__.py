"""Pipeline parallelism: the executor that walks a rank's schedule (``executor``: ``PipelineStage``,
``run_pipeline``), what crosses a stage boundary (``boundary``), where a stage sits and whom it
talks to (``placement``), the pre-flight exchange (``preflight``), its messages (``transport``)
and the split backward of zero-bubble schedules (``backward_split``). The schedules themselves are
data, shared with the planner: ``runtime.contract.schedule_ir``."""
