"""Tensor parallelism's transport: the torch.distributed groups and collectives (``comm``).
How a model splits is ``models.sharding``; the rank processes are ``runner.tp_workers``."""
