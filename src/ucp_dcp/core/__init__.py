"""Core arithmetic: boxes and layouts (sharding), pieces of logical tensors, and non-tensor
values."""
