"""Kubernetes control plane for the test suite, and the tests proving it is real."""
