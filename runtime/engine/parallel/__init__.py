"""Tensor parallelism on the engine side: rank 0's worker handle (workers.py) and the worker process."""
