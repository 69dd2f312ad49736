"""QuRL's policy losses: Adaptive Clipping Range (Eq. 9) and its token-level TIS baseline (Eq. 5).

`acr` holds the pure-torch math; `config` the verl config subclass and the driver-side check;
`registration.register()` puts `qurl_acr` / `qurl_tis` into verl's policy-loss registry.
"""
