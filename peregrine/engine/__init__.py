"""Request handling, scheduling, sampling and the engine loop.

The package's own namespace holds a request's types only: decode/ and speculative/ use penalties, sampling and
logprobs from here, and loading them must not load the engine loop above them (engine.py imports both; the
loop is `peregrine.engine.engine.LLMEngine`)."""
from .request import RequestError, RequestOutput, SamplingParams, StepInfo

__all__ = ["RequestError", "RequestOutput", "SamplingParams", "StepInfo"]
