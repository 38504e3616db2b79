"""Byte I/O: the range reader, moving bytes into tensors (transfer), checksums, durable writes."""
