"""The training path: a node's trainer, its packet pool, gradient codecs, robust aggregation and the contributor ledger."""
