"""Processes and their groups: launching ranks (``launch``), the (pp, dp, tp) mesh (``mesh``) and
the counted collectives every parallelism issues (``comm``)."""
