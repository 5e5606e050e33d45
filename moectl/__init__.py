"""moectl: run Mixture-of-Experts LLMs larger than your GPU."""

__version__ = "0.1.0"
