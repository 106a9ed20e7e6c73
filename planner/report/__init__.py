"""What a plan looks like to people and other tools: the printed report (``render``), the
schedule and memory plot (``plot``) and the equivalent DeepSpeed config (``deepspeed``)."""
