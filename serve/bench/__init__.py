"""`qwen35-bench`: replay throughput benchmark (`replay`) and synthetic request sets (`generate`)."""
