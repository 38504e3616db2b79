"""Adapters that describe other training layouts as pieces: flat ZeRO/FSDP1 shards, layout rules."""
