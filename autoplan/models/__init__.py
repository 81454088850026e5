"""Small models written in the repo (torchtitan style) for tests, demos and benchmarks."""
from autoplan.models.llama import Llama, LlamaConfig, build_llama
from autoplan.models.moe import MoEConfig, MoELlama, build_moe

__all__ = ["Llama", "LlamaConfig", "build_llama", "MoEConfig", "MoELlama", "build_moe"]
