"""Test support: a shared pool of gloo ranks and the fake process group for dry runs."""
from hyper_parallel.testing.fake_world import fake_world
from hyper_parallel.testing.meshes import cached_mesh
from hyper_parallel.testing.multirank import RankPool, free_port

__all__ = ["RankPool", "cached_mesh", "fake_world", "free_port"]
