"""The swarm: hivemind optimizer wrapper, commit decisions, agreement on state, presence and signed DHT records."""
