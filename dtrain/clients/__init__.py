"""Programs that talk to a dtrain node: the reference contributor, the split-inference client and the relay."""
