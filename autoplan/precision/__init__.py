"""Precision in plans: which Linears may train in float8 (``eligible``), which should (``choose``),
and the plan section that says so."""
