"""``backend=vllm``: ``engine`` (here: the jobs, the records) and ``worker`` (run in vLLM's own
environment, over JSON lines)."""
