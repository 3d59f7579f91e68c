"""The fleet simulation: N simulated replicas on one clock, routed as they stand."""
