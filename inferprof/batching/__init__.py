"""batching."""
