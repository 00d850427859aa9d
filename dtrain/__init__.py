"""The composition root: builds a node's pieces and hands them to the bridge (`dtrain-node`)."""
