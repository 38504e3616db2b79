"""CheckpointManager: async saves, atomic multi-tier commits, verified restore, retention."""
