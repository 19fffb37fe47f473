"""The admission bench's harness."""
