"""planner's training runtime.

Compiled stage modules import only ``torch`` and ``runtime``. This package never imports
``planner``, ``passes``, ``codegen`` or ``cost_models``.
"""

__version__ = "0.1.0"
