"""Test support: NumPy contract model and checks, toy expert, routings, launcher, kernel harness, protocol checker."""
