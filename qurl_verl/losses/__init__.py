"""QuRL's policy losses: Adaptive Clipping Range (Eq. 9) and its token-level TIS baseline (Eq. 5).

``acr``: the pure-torch math (no verl import). ``verl_losses``: ``loss_mode=qurl_acr`` /
``qurl_tis``, registered with verl's decorator when the plugin imports the module. ``config``:
the earlier name of the verl config dataclass that carries the loss settings to the workers
(``qurl_verl.settings.loss_config``).
"""
