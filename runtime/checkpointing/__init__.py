"""Training checkpoints: atomic saves, bit-for-bit resume, and loading under another plan."""
