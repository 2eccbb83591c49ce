"""Pure strategies the machines consult: parallelism (DP / TP / CP / your own plan()),
pipeline (PipelineParallel, PipelineChain) and task sampling. No I/O, no clock."""
