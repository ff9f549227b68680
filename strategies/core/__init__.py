"""The run's shared types, the bottom layer everything may import: ResolvedRun, ranges, ModelShape, ParallelDims, the model contract, document runs. It imports nothing of plait."""
