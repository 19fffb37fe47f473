"""Tiny GLM-DSA models for the CPU DSA backend's tests."""
