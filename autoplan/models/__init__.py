"""Small models written in the repo (torchtitan style) for tests, demos and benchmarks."""
from autoplan.models.llama import Llama, LlamaConfig, build_llama

__all__ = ["Llama", "LlamaConfig", "build_llama"]
