"""proxyvisor: an in-session supervisor proxy and gate for LLM agents."""

__version__ = "0.1.0"
