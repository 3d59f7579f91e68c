"""The fleet on Ray Serve (the `ray` extra); importing this package needs no Ray."""
