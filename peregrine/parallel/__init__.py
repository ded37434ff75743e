"""Tensor parallelism: the group and its collectives (group.py), what each rank holds
(shard.py), process launch (launch.py), and rank 0's step broadcast (control.py)."""
from .group import SINGLE, TPGroup  # noqa: F401
