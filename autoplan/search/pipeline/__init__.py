"""Pipeline parallel: stage cuts, schedule, micro-batches and virtual stages, timed by the runtime's
schedule simulator; which rank holds which parameter; a vision tower's place in the pipeline.
"""
