"""The cluster search: the dp x pp x tp (x cp x ep) meshes of a device count, each priced as a whole
plan with the pipeline, TP, expert and context searches, ranked into a winner and alternatives.
"""
