"""Context parallel: the price of splitting every sequence over a cp dimension -- the attention's K/V
exchange, the loss reduction and the memory it saves.
"""
