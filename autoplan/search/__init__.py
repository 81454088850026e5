"""The search: one package per concern, each answering one question the planner asks.

``units`` says what the model is to the planner (repeated blocks and their units, what each costs
to run); ``pricing`` prices a choice on the hardware (compute, collectives, per-rank shards);
``tp`` chooses every unit's tensor-parallel strategy (candidates, a run on the model, the ILP);
``pipeline`` cuts the model into stages and picks a schedule; ``experts`` and ``context`` price
expert and context parallelism; ``data`` the data-parallel mode and HSDP; ``mesh`` searches the
dp x pp x tp (x cp x ep) meshes of a device count with all of the above.
"""
