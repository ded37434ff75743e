"""Speculative decoding: drafters (n-gram prompt lookup, draft model), k + 1-token verification
on either decode path, and rollback of the KDA state / MLA cache to the last accepted token."""
from .config import SpeculativeConfig  # noqa: F401
