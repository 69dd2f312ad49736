"""Rule-based rewards, loadable by verl as `reward.custom_reward_function.path=pkg://qurl_recipes.rewards.<module>`."""
