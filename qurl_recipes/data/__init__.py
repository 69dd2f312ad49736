"""Dataset builders that write verl's RL parquet format (prompt chat list, reward_model, extra_info)."""
