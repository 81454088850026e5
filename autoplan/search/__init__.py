"""The search: model structure, strategies per unit, costs, and the ILP."""
from autoplan.search.mesh_spec import MeshSpec

__all__ = ["MeshSpec"]
