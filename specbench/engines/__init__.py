"""Other engines beside ours, run on the same prompts with the same records."""
