"""Single-process tools: Checkpoint, hand-off, Hugging Face export, inspection, the ucp-dcp CLI."""
