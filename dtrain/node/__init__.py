"""dtrain node: the shared model, the hivemind swarm and the training thread."""
