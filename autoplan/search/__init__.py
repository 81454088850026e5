"""The search: model structure, strategies per unit, costs, and the ILP."""
