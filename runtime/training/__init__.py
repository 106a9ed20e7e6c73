"""The trainer and what it reads and measures: its options (``train_config``), data as a function
of (seed, step) (``data``), and the step's memory and profiles (``memtrack``, ``profiling``)."""
