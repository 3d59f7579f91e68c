"""How a fleet chooses a replica: the request's hashes, the policies, the router."""
