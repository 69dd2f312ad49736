"""The reward functions the shipped `+qurl_recipe=` configs name, loaded by verl's reward workers as
`reward.custom_reward_function.path=pkg://qurl_verl.recipe_rewards.<module>`.

They are in the wheel because verl imports them in its reward worker, on whatever node and from whatever
directory the run starts: a module that lives only in the repository fails there, after the models have
loaded. Standard library only at import time; `boxed_math` calls verl's graders inside its functions.
"""
