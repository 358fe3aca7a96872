"""Attention kernels: shared-prefix attention over a read-only prefix and each row's own keys/values."""
