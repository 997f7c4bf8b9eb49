"""What every layer shares: the errors the command line reports, crash-safe file writes and
digests, the metrics interface the stages report through, freed memory given back between
stages, and the code a stage runs (its cache key's code part).
"""
