"""Run once at install time (`python -m qurl_verl.patches.install.<module> --install`)."""
