"""The front end: the model zoo and tracing (``torch.export`` on the meta device).

``zoo.build_model`` builds any spec, ``trace.trace_model`` exports it with repeated-block reuse,
``analyze.build_layer_table`` runs the passes over the trace and returns the layer table.
"""
