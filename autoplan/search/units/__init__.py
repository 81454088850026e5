"""Units: the model as the planner sees it -- repeated block groups with their attention, MLP, mixer
and norm units, the embedding and head, the modules no unit covers -- and what each costs to run.
"""
