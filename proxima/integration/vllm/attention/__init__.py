"""Attention backends over compressed blocks (CPU_ATTN and TRITON_ATTN subclasses) and the CPU read path."""
