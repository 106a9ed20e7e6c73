"""What ``planner compile`` wrote, loaded and run: the manifest and the per-stage modules
(``compiled_stages``), and those modules' layers under ``torch.compile`` (``compile_layers``)."""
