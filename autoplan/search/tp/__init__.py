"""Tensor parallel: every unit's strategy (replicated, Megatron column/row, sequence parallel, ...) for a
residual stream that is replicated or sequence-sharded, checked on the model and chosen by an ILP.
"""
