"""Stub HTTP servers that stand in for inference servers in tests."""
