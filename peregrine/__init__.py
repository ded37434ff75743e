"""peregrine: low-latency decode for Kimi-family hybrid MoE models.

The offline API (vLLM's): `from peregrine import LLM, SamplingParams` (peregrine/llm.py), imported on first use so
that `import peregrine` stays light.
"""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    if name in __all__:
        from . import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'peregrine' has no attribute {name!r}")
