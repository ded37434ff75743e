"""Request handling, scheduling, sampling and the engine loop."""
from .engine import LLMEngine
from .request import RequestError, RequestOutput, SamplingParams, StepInfo

__all__ = ["LLMEngine", "RequestError", "RequestOutput", "SamplingParams", "StepInfo"]
