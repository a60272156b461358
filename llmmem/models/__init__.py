"""Small reference models shared by llmmem's tests, benchmarks and examples."""

from llmmem.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
