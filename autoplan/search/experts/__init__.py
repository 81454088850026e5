"""Expert parallel: for each mixture-of-experts group, ExpertParallel against experts over tp, priced
with the runtime's dispatch; what an ep plan holds in memory; ep inside a pipeline.
"""
