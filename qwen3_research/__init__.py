"""qwen3_research: Hydra-configured Qwen3 training with torchtitan."""

__version__ = "0.1.0"
