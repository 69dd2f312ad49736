"""verl platforms added by qurl-verl (today: `cpu`, selected with VERL_PLATFORM=cpu)."""
