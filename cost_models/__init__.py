"""Costs of ops, collectives and memory for the planner: hardware data, roofline, profiles."""
