"""peregrine: low-latency decode for Kimi-family hybrid MoE models."""
__version__ = "0.1.0"
