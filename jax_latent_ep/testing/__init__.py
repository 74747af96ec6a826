"""Test support: NumPy contract model and checks, toy expert, routings, multi-process launcher, the dead-process
check."""
